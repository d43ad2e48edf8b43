#!/usr/bin/env bash
# The README's quick-start command, three times in a row, each under /usr/bin/time -v, with the
# CPU and the load average before each run written next to its output:
#     PSERVER=/work/venv/bin/pserver bash bench/results/quickstart/run.sh /work/shared/datasets/mnist
set -euo pipefail
data_dir=${1:?MNIST directory}
pserver=${PSERVER:-.venv/bin/pserver}
out=$(dirname "$0")
source "$out/../run_header.sh"
for i in 1 2 3; do
    run_header "$pserver launch --ps 2 --workers 4 --mode sync --dataset mnist --model mlp" \
               "--optimizer adam --lr 0.001 --batch-size 64 --epochs 2 --data-dir $data_dir" \
               "--summary-json $out/summary-$i.json" > "$out/run-$i.txt"
    /usr/bin/time -v "$pserver" launch --ps 2 --workers 4 --mode sync --dataset mnist --model mlp \
        --optimizer adam --lr 0.001 --batch-size 64 --epochs 2 --data-dir "$data_dir" \
        --summary-json "$out/summary-$i.json" >> "$out/run-$i.txt" 2>&1
    run_footer >> "$out/run-$i.txt"
done
