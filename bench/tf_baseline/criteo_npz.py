"""Write criteo-synthetic as the .npz that ps_wide_deep.py reads, from pserver's environment
(TensorFlow's has no pserver): the --samples training samples that `pserver --dataset
criteo-synthetic --samples N --seed S` trains on, then its --test-samples held-out ones
(their count under the key test_rows).

    .venv/bin/python bench/tf_baseline/criteo_npz.py --samples 1000000 --out criteo.npz
"""

from __future__ import annotations

import argparse

import numpy as np

from pserver.data import criteo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1_000_000, help="training samples (default 1,000,000)")
    p.add_argument("--test-samples", type=int, default=10_000, help="held-out samples (default 10,000, "
                   "as pserver's --test-samples)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the .npz to write")
    args = p.parse_args()
    data = criteo.load_synthetic(args.seed, args.samples, args.test_samples)
    x, y = criteo.generate(args.seed, data.bias, np.arange(args.samples, dtype=np.uint64))
    x, y = np.concatenate([x, data.x_test]), np.concatenate([y, data.y_test])
    np.savez(args.out, dense=x["dense"], cat=x["cat"], label=y.astype(np.float32),
             test_rows=np.int64(args.test_samples))
    print(f"{args.out}: {args.samples:,} training + {args.test_samples:,} test samples; "
          f"{data.describe()}")


if __name__ == "__main__":
    main()
