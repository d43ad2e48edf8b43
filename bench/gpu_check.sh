#!/usr/bin/env bash
# The checks of the CUDA path that need a real NVIDIA GPU, in one run that fits a short lease:
#
#   1. the CUDA tests on the device, not the simulator (tests/cuda_sim/check_*.py: kernels, products,
#      models, graphs, PTX)
#   2. bench/kernels.py: matmul (each kernel, and cuBLAS through CuPy), the MLP step (GPU against
#      one CPU core, with the step's copy/compute split), conv2d and the CNN step against cuDNN
#   3. MNIST with 2 workers and 1 CPU shard: the MLP and the reference CNN (or any --model), --device
#      cpu and cuda
#
#   bash bench/gpu_check.sh OUT_DIR [MNIST_DIR]
#
# OUT_DIR gets env.txt, tests.log, tests.xml, bench.log, kernels.json, mnist.log, mnist.json (each
# run's summary with its command, the CPU, cores and GPU).
# Environment: TESTS (the test files, default all of tests/cuda_sim/check_*.py), TESTS_LIMIT, BENCH_LIMIT (seconds), SECTIONS and BACKENDS (bench/kernels.py's),
# SIZES, CNN_BATCHES, SWEEP_MATMUL and SWEEP_CONV (its --sizes, --cnn-batches, --sweep-matmul and
# --sweep-conv), MNIST_GPU and MNIST_CPU (the models to
# run on each, default "mlp cnn"; "" for none; a --model spec such as bench/gpu_models.py:toy_resnet
# too, and MODEL@STEPS stops each worker after STEPS steps), MNIST_BATCH (per worker, default 128),
# MNIST_EPOCHS (default 1), MNIST_ARGS (more flags for each run, e.g. --data-assignment slices),
# MNIST_ONE_CORE=1 (the CPU runs with one thread per library in each process: one core per
# worker), MNIST_WORKERS (default 2), MNIST_GPU_LIMIT and MNIST_CPU_LIMIT (seconds per run), PROFILE_MODEL
# and PROFILE_RATE (step "profile": one cuda run under py-spy, every process, into profile.txt), and STEPS: the steps in order
# (default "tests mnist-gpu bench mnist-cpu"); a step written with a trailing "+" runs beside the
# next one (for the tests beside the CPU's MNIST runs, which use no GPU).
# Python packages missing on the machine can sit as wheels in .whl/ (installed into /tmp/site
# first). Each step has its own time limit, so one that hangs still leaves the others' results.
set -u
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR [MNIST_DIR]}
DATA=${2:-.gpu_data/mnist}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)                       # both as given from where it was started
[ -d "$DATA" ] && DATA=$(cd "$DATA" && pwd)
cd "$(dirname "$0")/.."
RUNS=$(mktemp -d)                             # this run's MNIST summaries, and only this run's
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stamp() { echo "== $(date +%T) $*"; }

{
  stamp env
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
  nproc; grep -m1 "model name" /proc/cpuinfo; $PY --version
  $PY - <<'EOF'
from importlib import metadata
for p in ("numpy", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x", "cupy-cuda12x", "torch",
          "grpcio", "protobuf", "hypothesis", "pytest", "scipy"):
    try:
        print(p, metadata.version(p))
    except metadata.PackageNotFoundError:
        print(p, "-")
from numba import cuda
cuda.detect()
EOF
} > "$OUT/env.txt" 2>&1

tests() {
  stamp "tests on the device" > "$OUT/tests.log"
  timeout ${TESTS_LIMIT:-160} $PY -m pytest -q -p no:cacheprovider -rfEs --durations=10 --junitxml="$OUT/tests.xml" \
    ${TESTS:-tests/cuda_sim/check_kernels_cuda.py tests/cuda_sim/check_gemm_cuda.py tests/cuda_sim/check_model_cuda.py \
    tests/cuda_sim/check_graph_cuda.py tests/cuda_sim/check_ptx.py} >> "$OUT/tests.log" 2>&1
  echo "exit $?" >> "$OUT/tests.log"
  tail -4 "$OUT/tests.log"
}

mnist() {   # mnist MODEL[@STEPS] DEVICE SECONDS (STEPS: --max-steps; the summary is named by MODEL's last part)
  local model=${1%@*} steps=""
  [ "$model" != "$1" ] && steps="--max-steps ${1##*@}"
  local name=${model##*:}
  local summary="$RUNS/mnist-${name##*/}-$2${MNIST_TAG:-}"
  local cmd=(${PROFILER:-} $PY -m pserver launch --ps 1 --workers ${MNIST_WORKERS:-2} --model "$model" --device "$2" $steps ${MNIST_ARGS:-}
             --dataset mnist --data-dir "$DATA" --epochs ${MNIST_EPOCHS:-1} --batch-size ${MNIST_BATCH:-128}
             --optimizer adam --lr 0.001 --summary-json "$summary.json")
  # the command as run, with the thread settings it ran under, for mnist.json
  { env | grep -E '^((OPENBLAS|OMP|MKL|NUMBA)_NUM_THREADS|PSERVER_CUDA_GRAPHS)=' | sort | tr '\n' ' '; printf '%q ' "${cmd[@]}"; } > "$summary.cmd"
  stamp "$1 $2" >> "$OUT/mnist.log"
  timeout "$3" "${cmd[@]}" >> "$OUT/mnist.log" 2>&1
  echo "exit $?" >> "$OUT/mnist.log"
}

mnist_gpu() {
  stamp "MNIST on the GPU" | tee -a "$OUT/mnist.log"
  for m in ${MNIST_GPU-mlp cnn}; do mnist "$m" cuda ${MNIST_GPU_LIMIT:-60}; done
}

profile() {   # one --device cuda run of PROFILE_MODEL (default cnn) under py-spy, every process sampled
  stamp "py-spy on MNIST, cuda" | tee -a "$OUT/mnist.log"
  local spy
  spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
  PROFILER="$spy record --subprocesses --idle --rate ${PROFILE_RATE:-200} --format raw --output $OUT/profile.txt --" \
    MNIST_TAG=-profiled mnist "${PROFILE_MODEL:-cnn}" ${PROFILE_DEVICE:-cuda} ${MNIST_GPU_LIMIT:-60}
}

mnist_cpu() (     # a subshell: the thread settings stay in it
  stamp "MNIST on the CPU" | tee -a "$OUT/mnist.log"
  if [ "${MNIST_ONE_CORE:-}" = 1 ]; then
    export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
  fi
  for m in ${MNIST_CPU-mlp cnn}; do mnist "$m" cpu ${MNIST_CPU_LIMIT:-30}; done
)

bench() {
  stamp "bench/kernels.py" | tee "$OUT/bench.log"
  timeout ${BENCH_LIMIT:-190} $PY bench/kernels.py --sizes ${SIZES:-1024,2048,4096} --batches 64,2048,4096 \
    --cnn-batches ${CNN_BATCHES:-64,256} --sections ${SECTIONS:-matmul,mlp,gpu-cnn} \
    --backends ${BACKENDS:-cpu1,cuda,cuda-t16,cuda-b64k16p,cuda-b128k16pc,cupy,torch} \
    ${SWEEP_MATMUL:+--sweep-matmul $SWEEP_MATMUL} ${SWEEP_CONV:+--sweep-conv $SWEEP_CONV} \
    --warmup-seconds 0.3 --min-seconds 0.5 --json "$OUT/kernels.json" >> "$OUT/bench.log" 2>&1
  echo "exit $?" >> "$OUT/bench.log"
}

: > "$OUT/mnist.log"
beside=""
for step in ${STEPS:-tests mnist-gpu bench mnist-cpu}; do
  fn=${step%+}; fn=${fn//-/_}
  if [ "$step" != "${step%+}" ]; then
    $fn & beside=$!
  else
    $fn
    [ -n "$beside" ] && wait "$beside"; beside=""
  fi
done
wait

$PY - "$OUT/mnist.json" "$RUNS" <<'EOF'
import json, os, subprocess, sys, pathlib
def cpu():
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
def gpu():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        out = ""
    return out or "none found (no nvidia-smi)"
runs = {}
for p in sorted(pathlib.Path(sys.argv[2]).glob("mnist-*.json")):
    d = json.loads(p.read_text())
    runs[p.stem[len("mnist-"):]] = {
        "command": p.with_suffix(".cmd").read_text().strip(), "cpu": cpu(), "cores": os.cpu_count(),
        "gpu": gpu(), **{k: d.get(k) for k in (
            "model", "num_workers", "num_shards", "batch_size", "epochs", "steps", "samples_trained",
            "test_accuracy", "test_loss", "train_samples_per_second", "wall_seconds", "launch_wall_seconds")},
        # each worker's split of its wall time: computing the gradient, the push and pull (waits for
        # the other workers included)
        "workers": [{k: w.get(k) for k in ("rank", "steps", "wall_seconds", "compute_seconds", "pull_seconds",
                                            "push_pull_seconds", "idle_fraction")} for w in d.get("workers", [])]}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1) + "\n")
for k, v in runs.items():
    print(k, v["test_accuracy"], round(v["train_samples_per_second"] or 0), v["wall_seconds"])
EOF
grep -E "^(size|[0-9]+ ) |x  |^  (what|matmul|conv|3x3)" "$OUT/bench.log" | tail -60
stamp done
