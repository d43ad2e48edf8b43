#!/usr/bin/env bash
# bench/sparse.py --shards 1 (the README's sparse table's 1-shard rows) at this checkout and at
# commit 61cdbf4 (before the table's parts on --table-threads), interleaved, ROUNDS rounds;
# each run's JSON (with the CPU and the load average at its start) and output here:
#     git archive 61cdbf4 | tar -x -C /tmp/src-61cdbf4
#     PYTHON=/work/venv/bin/python OLD=/tmp/src-61cdbf4 ROUNDS=3 bash bench/results/sparse-reruns/run.sh
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
old=${OLD:?a checkout of 61cdbf4}
out=$(cd "$(dirname "$0")" && pwd)
here=$(pwd)
for r in $(seq 1 "${ROUNDS:-3}"); do
    for version in head 61cdbf4; do
        src=$here; [ "$version" = 61cdbf4 ] && src=$old
        f="$out/round-$r-$version"
        (cd "$src" && echo "commit: $( [ "$version" = head ] && git rev-parse --short HEAD || echo 61cdbf4)" > "$f.txt" \
            && echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$f.txt" \
            && PYTHONPATH=$src "$python" bench/sparse.py --shards 1 --json "$f.json" --no-plot >> "$f.txt" 2>&1)
        echo "round $r $version: $(grep -h 'push\|pull' "$f.txt" | head -4 | tr '\n' ';')"
    done
done
