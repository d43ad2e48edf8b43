"""Sparse tables: 64-bit ids -> float32 rows that grow on first push and are evicted by age.

    hashing   splitmix64, shard_of (which shard holds an id), first_foreign, as_ids, initial_rows
    index     open addressing over uint64 keys stored once (the kernels the others share)
    dedupe    unique_inverse, segment_sum, TableLookup: a batch's ids made unique (worker side;
              PaddedIds: a list feature's, padding left out);
              first_repeat (the shard's check that a push's ids are distinct)
    optim     row optimizers (ROWS: sgd, adagrad, lazy adam, ftrl): numba kernels with NumPy twins
    table     TableConfig and SparseTable: one table on one shard (admission, eviction, state)
    state     RowState: a table's rows on one shard, as state() gives them and a checkpoint holds them
    merge     RowGrads, merge_rows: a step's pushed rows summed per table and id (the shard's side)

Every numba kernel has a NumPy twin (`*_numpy`, or a plain dict model for the table itself)
that the tests compare it with.
"""

from pserver.sparse.dedupe import PaddedIds, TableLookup, first_repeat, segment_sum, unique_inverse
from pserver.sparse.hashing import HASH_SEED, as_ids, first_foreign, initial_rows, shard_of, splitmix64
from pserver.sparse.merge import RowGrads, merge_rows
from pserver.sparse.optim import ROW_OPTIMIZERS, ROWS
from pserver.sparse.state import RowState
from pserver.sparse.table import SparseTable, TableConfig

__all__ = ["HASH_SEED", "PaddedIds", "ROWS", "ROW_OPTIMIZERS", "RowGrads", "RowState", "SparseTable",
           "TableConfig", "TableLookup", "as_ids", "first_foreign", "first_repeat", "initial_rows",
           "merge_rows", "segment_sum", "shard_of", "splitmix64", "unique_inverse"]
