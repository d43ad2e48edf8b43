"""The worker: the training loop (loop), the client of all shards (client) over gRPC or the
same-host data plane (dataplane), its side of compression (compress), and injected straggler
delays (stragglers).

`from pserver.worker import run_worker` (the names of the module pserver.worker was before the
packages) still works, with a DeprecationWarning: import them from pserver.worker.loop.
"""

from pserver._moved import forward

__getattr__ = forward(__name__, warn_now=False)
