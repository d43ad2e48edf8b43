"""How close to the planted model's AUC can any learner get on criteo-synthetic?

    .venv/bin/python bench/ctr_oracle.py --samples 1000000 --test-samples 100000

criteo-synthetic's labels come from a planted model whose per-id weights are N(0, 0.5^2); its
test AUC (`best_auc` in a run's summary) needs every id's weight. A learner only sees the ids
of its training samples, and estimates each weight from the samples that hold it. This prints
the test AUC of an oracle that knows the exact planted weight of every id seen at least k
times in training (and 0 for the rest, as a learner that never saw an id), keeping the planted
pairwise terms: an upper bound on what training on that many samples can reach. Beside it, the
same oracle without the pairwise terms (what lr can reach at best), and the difference: the
margin by which an fm or deepfm that learnt every pairwise term exactly could beat lr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines  # noqa: E402

from pserver.data import criteo  # noqa: E402
from pserver.models.metrics import auc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000, help="training samples (default 1M)")
    ap.add_argument("--test-samples", type=int, default=100_000, help="test samples (default 100k)")
    ap.add_argument("--seed", type=int, default=0, help="the dataset's seed (default 0)")
    ap.add_argument("--counts", default="1,2,5,10,30", help="k values (default 1,2,5,10,30)")
    args = ap.parse_args()
    print("\n".join(machine_lines(machine())))
    ds = criteo.load_synthetic(args.seed, args.samples, args.test_samples)
    train = np.concatenate([x["cat"] for x, _ in ds.epoch(0, 1, 10_000, args.seed, 0)])
    x, y = ds.x_test, ds.y_test
    full = ds.planted_logits(x)
    pairwise = full - criteo.planted(args.seed, x["cat"], pairwise=False)
    weights = criteo.planted_weights(args.seed, x["cat"])
    print(f"criteo-synthetic seed {args.seed}: {len(train):,} training and {len(x):,} test samples; "
          f"planted AUC {auc(full, y):.4f}, without its pairwise terms {ds.linear_auc:.4f}")
    for k in (int(c) for c in args.counts.split(",")):
        seen = np.zeros(x["cat"].shape, bool)
        for f in range(criteo.NUM_CAT):
            ids, counts = np.unique(train[:, f], return_counts=True)
            seen[:, f] = np.isin(x["cat"][:, f], ids[counts >= k])
        oracle = full - (weights * ~seen).sum(axis=1)
        linear = oracle - pairwise                 # the same oracle, as lr: no pairwise terms
        print(f"ids seen >= {k:2d} times in training: {seen.mean():.1%} of test ids; "
              f"oracle AUC {auc(oracle, y):.4f}, without its pairwise terms {auc(linear, y):.4f} "
              f"(margin {auc(oracle, y) - auc(linear, y):.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
