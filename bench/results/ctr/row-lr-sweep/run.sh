#!/usr/bin/env bash
# The README's CTR setting (1M criteo-synthetic samples, 100k test, one epoch, 2 shards, 4 workers,
# sync, batch 512 per worker, Adam 0.001 for the dense layers, row adagrad) for lr, fm and deepfm at
# --row-lr 0.05, 0.1 and 0.15, the models interleaved; each run's summary and output here, with
# the CPU and the load average before it; a table at the end (table.md):
#     PSERVER=/work/venv/bin/pserver PYTHON=/work/venv/bin/python bash bench/results/ctr/row-lr-sweep/run.sh
set -euo pipefail
pserver=${PSERVER:-.venv/bin/pserver}
python=${PYTHON:-.venv/bin/python}
out=$(dirname "$0")
source "$out/../../run_header.sh"
for row_lr in 0.05 0.1 0.15; do
    for model in lr fm deepfm; do
        f="$out/$model-row-lr-$row_lr"
        cmd=("$pserver" launch --ps 2 --workers 4 --mode sync --model "$model" --dataset criteo-synthetic
             --samples 1000000 --test-samples 100000 --batch-size 512 --optimizer adam --lr 0.001
             --row-optimizer adagrad --row-lr "$row_lr" --summary-json "$f.json")
        run_header "${cmd[@]}" > "$f.txt"
        "${cmd[@]}" >> "$f.txt" 2>&1
        run_footer >> "$f.txt"
    done
done
"$python" - "$out" > "$out/table.md" <<'PY'
import json, sys
from pathlib import Path
rows = ["| model | --row-lr | test AUC | test logloss | train samples/s | load before |", "|---|---|---|---|---|---|"]
for model in ("lr", "fm", "deepfm"):
    for lr in ("0.05", "0.1", "0.15"):
        base = Path(sys.argv[1]) / f"{model}-row-lr-{lr}"
        s = json.loads(Path(f"{base}.json").read_text())
        load = next(line.split(": ")[1].split()[0] for line in Path(f"{base}.txt").read_text().splitlines()
                    if line.startswith("load average before"))
        rows.append(f"| {model} | {lr} | {s['test_auc']:.4f} | {s['test_logloss']:.4f} | "
                    f"{s['train_samples_per_second']:,.0f} | {load} |")
print("\n".join(rows))
PY
cat "$out/table.md"
