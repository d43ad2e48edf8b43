"""keras_rs.layers.BruteForceRetrieval: each query's k best candidates, exactly, after training.

    retrieval = keras_rs.layers.BruteForceRetrieval(k=10)
    retrieval.update_candidates(candidate_embeddings, candidate_ids)    # (m, dim), (m,)
    top_scores, top_ids = retrieval(query_embeddings)                   # (n, k) each

The score of a query and a candidate is their dot product (`compute_score`: query @
candidates.T); each row of the result is sorted by score, highest first, and candidates of equal
score come in the order of their index among the candidates, lower first (as TensorFlow's
top_k, so a stable argsort of -scores: `top_k_reference`, the kernel's NumPy twin). Without
candidate_ids the ids are those indices.

It runs on arrays (a model's predictions: the towers' embeddings), not inside a model's graph:
a pserver model has one graph for training and inference, where Keras-RS's examples switch the
retrieval on in `call` when not training. The scores are computed a block of queries at a
time, so that a block's scores stay near SCORE_BLOCK_BYTES however many candidates there are.
"""

from __future__ import annotations

import abc

import numpy as np
from numba import njit

from pserver.errors import ConfigError, DataError
from pserver.layers.traced import snake_case
from pserver.ops.core import Symbolic

# The bytes of one block of scores (queries x candidates): large enough for BLAS to run at full
# speed, small enough that a million candidates do not take gigabytes.
SCORE_BLOCK_BYTES = 64 << 20


class Retrieval(abc.ABC):
    """Keras-RS's Retrieval: the base of a layer that gives each query its top k candidates,
    (top scores, top ids), or the ids alone with return_scores=False."""

    def __init__(self, k: int = 10, return_scores: bool = True, name: str | None = None, **kwargs):
        label = type(self).__name__
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ConfigError(f"{label}: k must be an integer >= 1, got {k!r}")
        if return_scores not in (True, False):
            raise ConfigError(f"{label}: return_scores must be True or False, got {return_scores!r}")
        if kwargs:
            raise ConfigError(f"{label}: {sorted(kwargs)[0]}= is not supported")
        self.k, self.return_scores = int(k), return_scores
        self.name = name or snake_case(label)

    @abc.abstractmethod
    def update_candidates(self, candidate_embeddings, candidate_ids=None) -> None:
        """The candidates from now on, and their ids (None: their indices)."""

    @abc.abstractmethod
    def call(self, inputs):
        """(top scores, top ids) of each query in `inputs`, or the ids (return_scores=False)."""

    def __call__(self, inputs, training=None):
        if isinstance(inputs, Symbolic):
            raise ConfigError(f"{type(self).__name__}: runs on arrays, after training (a pserver model has "
                              "one graph for training and inference): call it on the query tower's "
                              "embeddings, as model.predict gives them")
        return self.call(inputs)

    def compute_score(self, query_embedding, candidate_embedding) -> np.ndarray:
        """The dot product of each query and each candidate, (queries, candidates)."""
        return np.matmul(query_embedding, np.transpose(candidate_embedding))

    def _check_candidates(self, candidate_embeddings, candidate_ids) -> tuple:
        """The candidates as arrays; ConfigError for what Keras-RS refuses (DataError for NaN)."""
        label = type(self).__name__
        if candidate_embeddings is None:
            raise ConfigError(f"{label}: candidate_embeddings is required")
        emb = _floats(candidate_embeddings)
        if emb.ndim != 2:
            raise ConfigError(f"{label}: candidate_embeddings must be (num_candidates, embedding_dim), got "
                              f"shape {emb.shape}")
        if emb.shape[0] < self.k:
            raise ConfigError(f"{label}: {emb.shape[0]} candidates are fewer than the k={self.k} to retrieve")
        if not np.isfinite(emb).all():
            raise DataError(f"{label}: candidate_embeddings hold NaN or Inf")
        ids = None if candidate_ids is None else np.asarray(candidate_ids)
        if ids is not None and ids.shape != (emb.shape[0],):
            raise ConfigError(f"{label}: candidate_ids must be one id per candidate, ({emb.shape[0]},); got "
                              f"shape {ids.shape}")
        return emb, ids

    def get_config(self) -> dict:
        """k and return_scores (the candidates are not saved, as in Keras-RS: update them after
        from_config)."""
        return {"name": self.name, "k": self.k, "return_scores": self.return_scores}

    @classmethod
    def from_config(cls, config: dict) -> "Retrieval":
        return cls(**config)


class BruteForceRetrieval(Retrieval):
    """Keras-RS's BruteForceRetrieval: scores every candidate for each query and keeps the k
    best, sorted (ties: lower candidate index first). update_candidates replaces the candidates
    and their ids both (None: the indices); Keras-RS's, whose candidates are variables of a fixed
    shape, keeps earlier ids when given none."""

    def __init__(self, candidate_embeddings=None, candidate_ids=None, k: int = 10, return_scores: bool = True,
                 **kwargs):
        super().__init__(k=k, return_scores=return_scores, **kwargs)
        self.candidate_embeddings = self.candidate_ids = None
        if candidate_embeddings is None and candidate_ids is not None:
            raise ConfigError("BruteForceRetrieval: candidate_ids without candidate_embeddings")
        if candidate_embeddings is not None:
            self.update_candidates(candidate_embeddings, candidate_ids)

    def update_candidates(self, candidate_embeddings, candidate_ids=None) -> None:
        self.candidate_embeddings, self.candidate_ids = self._check_candidates(candidate_embeddings,
                                                                               candidate_ids)
        self._checked = (self.candidate_embeddings, self.candidate_ids)

    def call(self, inputs):
        emb, ids = self._candidates()
        query = _floats(inputs)
        if query.ndim != 2 or query.shape[1] != emb.shape[1]:
            raise ConfigError(f"BruteForceRetrieval: queries must be (n, {emb.shape[1]}) (the candidates' "
                              f"dim), got shape {query.shape}")
        if not np.isfinite(query).all():
            raise DataError("BruteForceRetrieval: the queries hold NaN or Inf")
        dtype = np.result_type(query.dtype, emb.dtype)
        scores, top = np.empty((len(query), self.k), dtype), np.empty((len(query), self.k), np.int64)
        rows = max(1, min(len(query), SCORE_BLOCK_BYTES // (emb.shape[0] * dtype.itemsize)))
        block = np.empty((rows, emb.shape[0]), dtype)      # one buffer: no page faults per block
        for a in range(0, len(query), rows):
            part = query[a:a + rows]
            got = self._scores(part, emb, block[:len(part)])
            top_k_into(got, self.k, scores[a:a + rows], top[a:a + rows])
        top_ids = top if ids is None else ids[top]
        return (scores, top_ids) if self.return_scores else top_ids

    def _candidates(self) -> tuple:
        """The candidates and their ids, checked again if they were set as attributes since
        (keras.io's basic_retrieval sets candidate_embeddings so)."""
        emb, ids = self.candidate_embeddings, self.candidate_ids
        if emb is None:
            raise ConfigError("BruteForceRetrieval: no candidates: give candidate_embeddings or call "
                              "update_candidates first")
        checked = getattr(self, "_checked", (None, None))
        if emb is not checked[0] or ids is not checked[1]:
            self.update_candidates(emb, ids)
        return self.candidate_embeddings, self.candidate_ids

    def _scores(self, query, emb, out) -> np.ndarray:
        """compute_score of a block of queries, into `out` unless a subclass computes its own."""
        if type(self).compute_score is Retrieval.compute_score:
            return np.matmul(query, emb.T, out=out)
        return np.ascontiguousarray(self.compute_score(query, emb), out.dtype)


def _floats(a) -> np.ndarray:
    """a as float32 or float64 (the kernel's two types): integers and halves as float32."""
    a = np.asarray(a)
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float32)


def top_k_reference(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k highest scores and their indices, highest first, equal scores by index: the
    definition (a stable argsort of -scores), the twin of `top_k_into`."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, top, axis=1), top


@njit(cache=True, nogil=True)
def top_k_into(scores, k, top_scores, top_index):
    """Each row's k highest scores into top_scores and their indices into top_index (n, k),
    sorted as top_k_reference's. One pass per row with a heap of the k best so far, whose root
    is the worst of them: a later candidate enters only with a higher score (one of equal score
    comes later, so it ranks lower), so most candidates cost one comparison."""
    for r in range(scores.shape[0]):
        row, hs, hi = scores[r], top_scores[r], top_index[r]
        for j in range(k):                   # the first k, then made a heap
            hs[j], hi[j] = row[j], j
        for c in range(k // 2 - 1, -1, -1):
            _sift_down(hs, hi, c, k)
        for j in range(k, row.shape[0]):
            if row[j] > hs[0]:
                hs[0], hi[0] = row[j], j
                _sift_down(hs, hi, 0, k)
        for end in range(k - 1, 0, -1):      # heap sort: the worst to the back, one at a time
            hs[0], hs[end] = hs[end], hs[0]
            hi[0], hi[end] = hi[end], hi[0]
            _sift_down(hs, hi, 0, end)


@njit(cache=True, nogil=True, inline="always")
def _worse(hs, hi, a, b):
    """Entry a ranks below entry b: a lower score, or an equal one at a higher index."""
    return hs[a] < hs[b] or (hs[a] == hs[b] and hi[a] > hi[b])


@njit(cache=True, nogil=True)
def _sift_down(hs, hi, c, size):
    """Restore the heap (the worst entry at the root) below position c, among the first `size`."""
    while True:
        w, left = c, 2 * c + 1
        if left < size and _worse(hs, hi, left, w):
            w = left
        if left + 1 < size and _worse(hs, hi, left + 1, w):
            w = left + 1
        if w == c:
            return
        hs[c], hs[w] = hs[w], hs[c]
        hi[c], hi[w] = hi[w], hi[c]
        c = w


__all__ = ["Retrieval", "BruteForceRetrieval", "top_k_into", "top_k_reference", "SCORE_BLOCK_BYTES"]
