"""What the bench scripts share: the machine they ran on, median/min/max, a text table."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from importlib import metadata
from pathlib import Path
from typing import Sequence

# Where results go unless a path is given: ./results/ under the directory the script runs in,
# the user's own. The committed figures in bench/results/ change only when a path there is given.
RESULTS = Path("results")


def result_path(given: str | None, name: str) -> Path:
    """The path asked for, else results/NAME; its directory is created."""
    path = Path(given) if given else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def positive_ints(text: str) -> list[int]:
    """argparse type: '1024,2_048' -> [1024, 2048]; positive integers only."""
    try:
        values = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': give positive integers")
    return values


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_id() -> dict:
    """What a CPU is when its model name says little ("AMD EPYC" in a VM): family, model and
    stepping, and the widest vector instructions it offers (the kernels' speed follows them)."""
    info: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in ("cpu family", "model", "stepping", "flags") and key not in info:
                    info[key] = value
    except OSError:
        return {}
    flags = set(info.pop("flags", "").split())
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sse4_2", "SSE4.2"))
                if flag in flags), "unknown")
    return {**info, "isa": isa}


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(packages: Sequence[str] = ("grpcio", "numpy")) -> dict:
    """Date, CPU, cores, load and versions: printed first and kept with every result."""
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]),
            "cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            # off (PYTHONDONTWRITEBYTECODE, python -B): every process compiles what it imports from
            # source, inside a timed fit too where a module is imported there (0.3-0.5 s of a
            # DCN fit: docs/performance/keras-io.md)
            "bytecode_cache": "off" if sys.dont_write_bytecode else "on",
            **{p: version(p) for p in packages}}


def machine_lines(m: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in m.items()
                         if k not in ("date", "command", "cpu", "cpu_id", "cores", "load_avg_1m",
                                      "bytecode_cache"))
    # The load average says whether something else was running: on a small machine
    # another process halves a figure without any change in the code measured.
    return [f"date: {m['date']}", f"command: {m.get('command', '')}",
            f"cpu: {m['cpu']} {m.get('cpu_id', '')}, {m['cores']} cores, "
            f"load average (1 min) {m['load_avg_1m']} at start",
            f"versions: {versions}"] + ([f"python bytecode cache: {m['bytecode_cache']}"]
                                        if "bytecode_cache" in m else [])


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns align left, the rest right."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)
