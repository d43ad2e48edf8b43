"""What tests share that is not a fixture. A test module imports from here, never from another
test module or a conftest (tests/test_layout.py checks it); fixtures live in the conftests.

    shards      in-process shards (make_cluster, one_shard) and what tests do to them
    pushes      a PushRequest by name (push_request), fill_with, push, push_all
    clients     real clients of a live shard: over gRPC (ready_client, raw_push), on the data
                plane (worker, raw_hello)
    processes   real pserver processes (Proc, run), waiting on them, reading their output;
                missing(), the one way a test says that what it needs is not here
    simulator   the CUDA simulator modules (tests/cuda_sim/), run beside the suite
    certs       throwaway TLS material
    criteo      Criteo lines and files
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]   # the checkout: README.md, docs/, bench/
