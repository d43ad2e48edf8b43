"""What both ends of the wire share: the gRPC chunk codec (codec), the same-host data plane's
frames (frames), the compression formats and kernels (compress), the token and TLS checks
(security) and the sharding of the flat vector (sharding). Each end's code lives with that
end: pserver.server and pserver.worker.
"""
