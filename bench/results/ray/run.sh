#!/usr/bin/env bash
# `pserver launch --backend ray` against the local backend on tests/e2e/test_ray.py's run (2 shards,
# 2 workers, sync, logistic regression on 6,000 synthetic samples, 2 epochs), ROUNDS rounds of
# local then ray, each under /usr/bin/time -v with the CPU and the load average before it:
#     PSERVER=/work/venv/bin/pserver ROUNDS=2 bash bench/results/ray/run.sh
set -euo pipefail
pserver=${PSERVER:-.venv/bin/pserver}
out=$(dirname "$0")
source "$out/../run_header.sh"
for r in $(seq 1 "${ROUNDS:-2}"); do
    for backend in local ray; do
        f="$out/round-$r-$backend"
        cmd=("$pserver" launch --backend "$backend" --ps 2 --workers 2 --mode sync --seed 3 --model logreg
             --dataset synthetic --samples 6000 --features 40 --batch-size 32 --epochs 2 --log-every 0.5
             --summary-json "$f.json")
        run_header "${cmd[@]}" > "$f.txt"
        /usr/bin/time -v "${cmd[@]}" >> "$f.txt" 2>&1
        run_footer >> "$f.txt"
        echo "round $r $backend: $(grep -h 'Elapsed (wall' "$f.txt")"
    done
done
