"""Every byte pserver writes to disk, and reads back: one atomic writer (atomic), a shard's
checkpoint files and their chains (checkpoint), a checkpoint directory across shards and shapes
(directory), checkpoints restored onto another number of shards (reshard), the model file and
its memory-mapped tables (model_file), and checkpoints read offline (export). No gRPC and no
server here: pserver.server decides when a shard writes, and calls these."""
