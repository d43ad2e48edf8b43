"""numpy's and scipy's wheels each bundle an OpenBLAS; pserver.kernels.cpu sets numpy's pool to
one thread so the two do not spin against each other (bench/blas_pools.py: a 512x192x192
np.dot then Dense's backward, 9.7 ms with both pools at 2 threads on 2 cores, 0.8 ms so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json
from threadpoolctl import threadpool_info
from pserver.kernels import cpu
pools = {("numpy" if "numpy" in i["filepath"] else "scipy"): i["num_threads"] for i in threadpool_info()
         if i["internal_api"] == "openblas"}
print(json.dumps({"pools": pools, "was": cpu.NUMPY_BLAS_THREADS}))
"""


def test_numpy_s_blas_pool_runs_one_thread_and_the_kernels_keep_theirs():
    """Catches the setting lost (numpy's pool left at 2: a DCN fit in one process 3.4x slower,
    bench/results/kernels/blas_pools.json) or put on the wrong pool (scipy's, which Dense,
    Conv2D and the recurrent layers' products use, at 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout)
    assert got == {"pools": {"numpy": 1, "scipy": 2}, "was": 2}, got
