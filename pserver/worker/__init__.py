"""The worker: the training loop (loop), the client of all shards (client) over gRPC or the
same-host data plane (dataplane), its side of compression (compress), the session file
(sessions) and injected straggler delays (stragglers).
"""
