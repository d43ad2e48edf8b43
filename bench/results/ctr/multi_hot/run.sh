#!/bin/bash
# DLRM on criteo-synthetic and on criteo-synthetic-multi-hot (MLPerf DLRMv2's list sizes, 214 ids
# a sample against 26), the same flags: what a model reaches against each data's planted AUC,
# and what list features cost a worker. Run from the repository root, with pserver on PATH:
#   bash bench/results/ctr/multi_hot/run.sh
# Each run writes NAME.txt (the header below, then the output) and NAME.json (the run summary,
# with the header's command, CPU, instruction set, load and commit added as "run").
set -e
here=bench/results/ctr/multi_hot
source bench/results/run_header.sh
for data in criteo-synthetic criteo-synthetic-multi-hot; do
    cmd="pserver launch --ps 2 --workers 2 --model dlrm --dataset $data --samples 200000 --test-samples 20000
         --batch-size 512 --optimizer adam --lr 0.001 --row-optimizer adagrad --row-lr 0.05 --epochs 1
         --summary-json $here/dlrm-$data.json"
    { run_header $cmd; $cmd 2>&1 | grep -v " step [0-9]*/[0-9]* " ; run_footer; } > $here/dlrm-$data.txt
    python3 bench/results/ctr/multi_hot/add_run.py $here/dlrm-$data.txt $here/dlrm-$data.json
done
