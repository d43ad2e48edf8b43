"""The worker: the training loop (loop) over a batch source (sources: its own slice, or leases
from shard 0), what one run's steps share (run), the client of all shards (client) over gRPC or
the same-host data plane (dataplane), its side of compression (compress), the session file
(sessions) and injected straggler delays (stragglers).
"""
