"""Where a worker computes its gradients: `--device cpu | cuda | cuda:I`.

    parse_device   the flag's form only; imports nothing (config validation calls it)
    select         the worker: checks the device is there and makes it current
    describe       the worker's first line: which device it really runs on
    round_robin    the launcher: one device per worker, spread over the visible GPUs

`cuda:I` counts among the visible devices, as CUDA does: with CUDA_VISIBLE_DEVICES=2,3,
cuda:0 is physical GPU 2. `cuda` alone means cuda:0 to a worker and "spread them" to the
launcher. numba.cuda is imported inside the functions that need it, so a CPU-only install
never imports it. With NUMBA_ENABLE_CUDASIM=1 in the environment (numba reads it once, at
import) the CUDA kernels run in numba's simulator, which has exactly one device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pserver.errors import ConfigError

_SPEC = re.compile(r"cuda:(\d+)")


@dataclass(frozen=True)
class Device:
    kind: str                 # "cpu" or "cuda"
    index: int | None = None  # cuda: ordinal among the visible devices; None: not chosen yet

    def __str__(self) -> str:
        if self.kind == "cpu" or self.index is None:
            return self.kind
        return f"{self.kind}:{self.index}"

    @property
    def backend(self) -> str:
        """The kernel backend, as `make_model(..., backend=...)` takes it."""
        return self.kind


def parse_device(spec: str) -> Device:
    """"cpu", "cuda" or "cuda:I" (I >= 0) -> Device; anything else is a ConfigError."""
    s = spec.strip().lower() if isinstance(spec, str) else ""
    if s in ("cpu", "cuda"):
        return Device(s)
    m = _SPEC.fullmatch(s)
    if m:
        return Device("cuda", int(m.group(1)))
    raise ConfigError(f"--device: unknown device {spec!r}; use cpu, cuda or cuda:I "
                      f"(I >= 0, an index among the visible GPUs)")


def select(device: Device) -> Device:
    """Check that `device` is there and make it this process's current device.

    Returns the device with its index filled in (cuda -> cuda:0). Call it once, before the
    model is built: a CUDA model binds to the device that is current when it is made.
    """
    if device.kind == "cpu":
        return device
    cuda = _import_cuda(device)
    count = _count_visible(cuda)
    if count == 0:
        raise ConfigError(_no_gpu_message(device))
    index = device.index or 0
    if index >= count:
        where = "the CUDA simulator has one" if is_simulator() else _visible_env()
        choices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ConfigError(f"--device {device}: only {count} CUDA device(s) visible ({where}); "
                          f"use {choices}")
    if not is_simulator() and not cuda.is_available():
        # The driver sees a GPU, but numba finds no NVVM to compile kernels with.
        raise ConfigError(f"--device {device}: a GPU is visible but numba cannot compile for it "
                          f"(no NVVM/libdevice found); install pserver[cuda] or a CUDA toolkit")
    if not is_simulator():
        check_compiler(device)
    cuda.select_device(index)
    return Device("cuda", index)


def _noop(a):
    a[0] = 0.0


def check_compiler(device: Device) -> None:
    """Compile one tiny kernel, so that a numba-cuda that cannot compile with the installed
    numpy fails here, in one line, rather than in the middle of the first step. Seen on a GPU
    machine: numba-cuda 0.30.4 with numpy 2.5, which removed np.row_stack (AttributeError while
    numba-cuda loads its NumPy support)."""
    try:
        from numba import cuda, types  # inside: a numba-cuda may read numpy's names as it loads
        cuda.compile_ptx(_noop, (types.float32[::1],), cc=(7, 5))
    except AttributeError as e:
        from importlib import metadata

        import numpy as np
        try:
            version = metadata.version("numba-cuda")
        except metadata.PackageNotFoundError:
            version = "(numba's own)"
        raise ConfigError(f"--device {device}: numba-cuda {version} cannot compile kernels with "
                          f"numpy {np.__version__} ({e}); install numpy<2.5 "
                          f"(pip install 'pserver[cuda]' pins it)") from e


def describe(device: Device) -> str:
    """What the device is, for a log line: 'cpu', 'cuda:0 (CUDA simulator)',
    'cuda:1 (NVIDIA H100 80GB HBM3, compute capability 9.0)'. After `select`."""
    if device.kind == "cpu":
        return "cpu"
    if is_simulator():
        return f"{device} (CUDA simulator)"
    from numba import cuda
    gpu = cuda.gpus[device.index or 0]
    name = gpu.name.decode() if isinstance(gpu.name, bytes) else str(gpu.name)
    major, minor = gpu.compute_capability
    return f"{device} ({name}, compute capability {major}.{minor})"


def blas_note(device: Device) -> str | None:
    """A line for the chief when OPENBLAS_CORETYPE is set and it computes on the CPU: the matrix
    products then run the kernels it names, not OpenBLAS's choice for this CPU (Haswell's AVX2 on
    an AVX-512 core takes twice as long); None otherwise."""
    core = os.environ.get("OPENBLAS_CORETYPE")
    if device.kind != "cpu" or not core:
        return None
    return (f"CPU matrix products: OpenBLAS's {core} kernels, as OPENBLAS_CORETYPE says (unset it to let "
            f"OpenBLAS choose for this CPU)")


def round_robin(num_workers: int, spec: str) -> list[str]:
    """The --device of each worker rank: "cuda" spreads ranks over the visible GPUs
    (rank r gets cuda:r mod G); "cpu" and "cuda:I" give every rank the same device."""
    device = parse_device(spec)
    if device.kind == "cpu" or device.index is not None:
        return [str(device)] * num_workers
    count = visible_gpus(device)
    if count == 0:
        raise ConfigError(_no_gpu_message(device))
    return [f"cuda:{r % count}" for r in range(num_workers)]


def current_index() -> int:
    """This thread's current CUDA device (cuda:0 if nothing was selected): what a CUDA model
    binds to. A ConfigError, as from `select`, when there is none."""
    cuda = _import_cuda(Device("cuda"))
    if _count_visible(cuda) == 0:
        raise ConfigError(_no_gpu_message(Device("cuda")))
    # The simulator's one device has no id.
    return int(getattr(cuda.current_context().device, "id", 0))


def visible_gpus(device: Device = Device("cuda")) -> int:
    """How many CUDA devices this process can use (1 in the simulator, 0 with none)."""
    return _count_visible(_import_cuda(device))


def is_simulator() -> bool:
    """Whether numba.cuda is numba's simulator (NUMBA_ENABLE_CUDASIM=1 when numba was imported)."""
    from numba import cuda
    return bool(getattr(cuda.config, "ENABLE_CUDASIM", 0))


def _import_cuda(device: Device):
    try:
        from numba import cuda
    except ImportError as e:  # numba-cuda installed without its CUDA bindings, for one
        raise ConfigError(f"--device {device}: numba.cuda cannot be imported ({e}); "
                          f"install the GPU extra: pip install 'pserver[cuda]'") from e
    return cuda


def _count_visible(cuda) -> int:
    if is_simulator():
        return len(cuda.gpus)
    # Not importable from the simulator, whose numba.cuda.cudadrv is a stand-in.
    from numba.cuda.cudadrv.error import CudaDriverError, CudaSupportError
    try:
        # The driver's count already leaves out what CUDA_VISIBLE_DEVICES hides.
        return len(cuda.gpus)
    except (CudaSupportError, CudaDriverError):   # no driver, or no device at all
        return 0


def _visible_env() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return "CUDA_VISIBLE_DEVICES=<unset>"
    return f"CUDA_VISIBLE_DEVICES={value}" if value else 'CUDA_VISIBLE_DEVICES=""'


def _no_gpu_message(device: Device) -> str:
    return (f"--device {device}: no CUDA GPU is visible ({_visible_env()}); use --device cpu, "
            f"or set NUMBA_ENABLE_CUDASIM=1 to run the CUDA kernels in numba's simulator")


__all__ = ["Device", "parse_device", "select", "describe", "round_robin", "visible_gpus",
           "current_index", "is_simulator"]
