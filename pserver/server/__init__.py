"""A shard: the gRPC app and servicer, the shard's state (shard, store), who its workers are
(membership), the same-host data plane's server (dataplane), its side of compression
(compress), checkpoints, limits and health."""
