"""StringLookup, IntegerLookup and TextVectorization: Keras's lookup and text layers, in NumPy.

They are not differentiable and hold no weights: a vocabulary (from `adapt`, `vocabulary=` or
`set_vocabulary`) maps tokens to indices, as Keras's: the mask token (int mode) at 0, the
`num_oov_indices` out-of-vocabulary indices next, then the tokens, most frequent first, ties in
descending token order (Keras sorts `np.lexsort((tokens, counts))[::-1]`). Called on arrays
(str, bytes or ints) they compute now; called on a keras.Input they are the first layers of a
model, which runs them on the data before the rest (pserver.models.functional: `preprocess`),
so the shards, the wire and the loop see their output (ids or counts) only. Their vocabulary
is part of the model's layout signature: every worker of a cluster must hold the same one
(docs/semantics.md).

Differences from Keras (docs/guide/keras.md): outputs other than "int" are float32 (Keras's
eager multi_hot and count are int64); invert returns str (Keras's: bytes); a string's OOV index
when num_oov_indices > 1 comes from CRC-32, not FarmHash64; sparse=True, ragged=True, custom
callables for standardize and split, and a vocabulary file are refused.
"""

from __future__ import annotations

import abc
import collections
import re
import zlib

import numpy as np

from pserver.errors import ConfigError
from pserver.layers.base import Layer
from pserver.ops.core import Node, Symbolic

MODES = ("int", "one_hot", "multi_hot", "count", "tf_idf")
# Keras's strip_punctuation (tf.strings.regex_replace's pattern, which Python's re reads alike).
PUNCTUATION = re.compile(r'[!"#$%&()\*\+,-\./:;<=>?@\[\\\]^_`{|}~\']')
# tf.strings.split and tf.strings.lower act on ASCII only: "\xa0" joins words, "É" stays.
WHITESPACE = re.compile(r"[ \t\n\r\v\f]+")
ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class Preprocessing(Layer):
    """A layer that runs on a model's data before the model (no weights, no gradient): called on
    a keras.Input, it records its node with its output's dtype; on arrays it computes now."""

    preprocessing = True
    input_dtype = "str"

    def __call__(self, inputs, training=None, **kwargs):
        if kwargs:
            raise ConfigError(f"{self.label}: takes no argument {sorted(kwargs)[0]!r} when called")
        if not isinstance(inputs, Symbolic):
            return self.apply(inputs)
        if getattr(self, "invert", False):
            raise ConfigError(f"{self.label}: invert=True gives tokens, which no layer takes: call it on "
                              "arrays (a model's predictions), not in a model")
        self.build_once(inputs.shape[1:])
        self._called = True
        node = Node(self.kind, [inputs], {}, layer=self)
        node.outputs.append(Symbolic((None, *self.output_shape), self.output_dtype, node, 0))
        return node.outputs[0]

    @property
    def output_dtype(self) -> str:
        return "int64" if self.output_mode == "int" else "float32"

    def lock(self, model: str) -> None:
        """A built model holds this layer's vocabulary (its layout's signature, its width)."""
        self._locked = model

    def _changing(self) -> None:
        locked = getattr(self, "_locked", None)
        if locked is not None:
            raise ConfigError(f"{self.label}: its vocabulary is part of the built model {locked!r} (its "
                              "layout's signature): adapt or set it before the model's first fit, "
                              "evaluate, predict or summary")

    def forward(self, k, p, x, out, s, run):
        raise ConfigError(f"{self.label}: runs on the data before the model (Functional.preprocess)")

    def backward(self, k, p, g, x, out, dout, dx, s):
        raise ConfigError(f"{self.label}: has no gradient")


class IndexLookup(Preprocessing):
    """What StringLookup and IntegerLookup share: the vocabulary, adapt, lookup, invert and the
    encodings (Keras's IndexLookup)."""

    def __init__(self, max_tokens=None, num_oov_indices=1, mask_token=None, oov_token=None,
                 vocabulary=None, idf_weights=None, invert=False, output_mode="int", sparse=False,
                 pad_to_max_tokens=False, **kwargs):
        super().__init__(**kwargs)
        owner = type(self).__name__
        output_mode = _checked_mode(owner, output_mode, invert, sparse, idf_weights)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 1):
            raise ConfigError(f"{owner}: max_tokens must be None or an integer > 1, got {max_tokens!r}")
        if pad_to_max_tokens and max_tokens is None:
            raise ConfigError(f"{owner}: pad_to_max_tokens=True needs max_tokens")
        if not isinstance(num_oov_indices, int) or num_oov_indices < 0:
            raise ConfigError(f"{owner}: num_oov_indices must be an integer >= 0, got {num_oov_indices!r}")
        self.max_tokens, self.num_oov_indices = max_tokens, num_oov_indices
        self.mask_token, self.oov_token = self._token(mask_token), self._token(oov_token)
        self.invert, self.output_mode = bool(invert), output_mode
        self.pad_to_max_tokens = bool(pad_to_max_tokens)
        self._tokens: list | None = None
        self._index: dict = {}
        self.idf_weights: np.ndarray | None = None
        if vocabulary is not None:
            self.set_vocabulary(vocabulary, idf_weights)
        elif output_mode == "tf_idf" and idf_weights is not None:
            raise ConfigError(f"{owner}: idf_weights without a vocabulary")

    # -- tokens ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _token(self, value):
        """A value as this layer's token (str, or int for IntegerLookup); None stays None."""

    @abc.abstractmethod
    def _tokens_of(self, values) -> np.ndarray:
        """An array of values as tokens (an object array of str, or int64)."""

    def _oov_start(self) -> int:
        return 1 if self.mask_token is not None and self.output_mode == "int" else 0

    def _token_start(self) -> int:
        return self._oov_start() + self.num_oov_indices

    # -- the vocabulary ---------------------------------------------------------------------------

    def set_vocabulary(self, vocabulary, idf_weights=None) -> None:
        """Keras's: the tokens (the mask and OOV tokens may lead, in their order), and for tf_idf
        the idf weights (one per entry of `vocabulary`)."""
        self._changing()
        if isinstance(vocabulary, (str, bytes)):
            raise ConfigError(f"{self.label}: a vocabulary file is not supported: give the tokens as a list")
        if (self.output_mode == "tf_idf") != (idf_weights is not None):
            raise ConfigError(f"{self.label}: idf_weights must be given exactly when output_mode='tf_idf'")
        given = [self._token(v) for v in np.asarray(vocabulary, dtype=object).reshape(-1)]
        if not given:
            raise ConfigError(f"{self.label}: cannot set an empty vocabulary")
        lead, tokens = self._without_specials(given)
        if idf_weights is not None:
            idf_weights = self._idf_given(idf_weights, len(given), lead)
        self._set(tokens, idf_weights)

    def _without_specials(self, given: list) -> tuple[bool, list]:
        """(whether `given` starts with the special tokens, in order; the tokens after them),
        ConfigError for a repeated token or a special one among the tokens (as Keras's)."""
        specials = [self.mask_token] * self._oov_start() + [self.oov_token] * self.num_oov_indices
        lead = given[:len(specials)] == specials
        tokens = given[len(specials):] if lead else given
        repeated = [t for t, c in collections.Counter(tokens).items() if c > 1]
        if repeated:
            raise ConfigError(f"{self.label}: the vocabulary repeats {repeated[:5]}")
        for what, special in (("mask_token", self.mask_token), ("oov_token", self.oov_token if self.invert
                                                                else None)):
            if special is not None and special in tokens:
                raise ConfigError(f"{self.label}: the vocabulary holds the {what} {special!r} among its "
                                  f"tokens; give the special tokens first, in this order: {specials}")
        return lead, tokens

    def _idf_given(self, idf_weights, n: int, lead: bool) -> np.ndarray:
        """The idf weights padded as Keras's: their mean in front for the special tokens when the
        vocabulary left them out, zeros behind up to max_tokens with pad_to_max_tokens."""
        w = np.asarray(idf_weights, dtype=np.float64).reshape(-1)
        if len(w) != n:
            raise ConfigError(f"{self.label}: idf_weights has {len(w)} values for {n} vocabulary entries")
        front = 0 if lead else self._token_start()
        back = self.max_tokens - front - len(w) if self.pad_to_max_tokens else 0
        padded = np.pad(w, (front, max(back, 0)), constant_values=(w.mean() if front else 0, 0))
        return padded.astype(np.float32)

    def _set(self, tokens: list, idf: np.ndarray | None) -> None:
        size = self._token_start() + len(tokens)
        if self.max_tokens is not None and size > self.max_tokens:
            raise ConfigError(f"{self.label}: a vocabulary of {size} entries is larger than max_tokens="
                              f"{self.max_tokens}")
        if (getattr(self, "_called", False) and self.output_mode != "int" and not self.pad_to_max_tokens
                and size != self.output_shape[-1]):
            raise ConfigError(f"{self.label}: its output width is fixed once called on a keras.Input "
                              f"({self.output_shape[-1]}); the vocabulary would make it {size}")
        self._tokens = list(tokens)
        start = self._token_start()
        self._index = {t: start + i for i, t in enumerate(self._tokens)}
        self.idf_weights = idf

    def adapt(self, data, steps=None) -> None:
        """The vocabulary from `data` (an array or list, or an iterable of batches; `steps`:
        batches to read from an iterable), by frequency as Keras's; tf_idf: each row of a 2-D
        batch (each value of a 1-D one) is a document."""
        self._changing()
        counts, docs, n_docs = collections.Counter(), collections.Counter(), 0
        for batch in _batches(data, steps, self.label):
            rows = self._documents(batch)
            for row in rows:
                counts.update(row)
                docs.update(set(row))
            n_docs += len(rows)
        for special in (self.mask_token, self.oov_token):
            counts.pop(special, None)
        self._set_adapted(counts, docs, n_docs)

    def _documents(self, batch) -> list[list]:
        """A batch of data as documents of tokens: rows of a 2-D array, values of a 1-D one."""
        a = self._tokens_of(batch)
        a = a.reshape(-1, 1) if a.ndim <= 1 else a.reshape(len(a), -1)
        return [row.tolist() for row in a]

    def _set_adapted(self, counts: collections.Counter, docs: collections.Counter, n_docs: int) -> None:
        if not counts:
            raise ConfigError(f"{self.label}: adapt found no tokens in the data")
        # Keras's order: by count, ties by token, both descending.
        tokens = sorted(counts, key=lambda t: (counts[t], t), reverse=True)
        if self.max_tokens:
            tokens = tokens[:self.max_tokens - self._token_start()]
        idf = None
        if self.output_mode == "tf_idf":
            w = np.log(1 + n_docs / (1 + np.array([docs[t] for t in tokens], dtype=np.float64)))
            back = self.max_tokens - self._token_start() - len(w) if self.pad_to_max_tokens else 0
            idf = np.pad(w, (self._token_start(), back), constant_values=(w.mean(), 0)).astype(np.float32)
        self._set(tokens, idf)

    def get_vocabulary(self, include_special_tokens=True) -> list:
        tokens = list(self._tokens or [])
        if not include_special_tokens:
            return tokens
        return [self.mask_token] * self._oov_start() + [self.oov_token] * self.num_oov_indices + tokens

    def vocabulary_size(self) -> int:
        return self._token_start() + len(self._tokens or [])

    def _known(self) -> None:
        if self._tokens is None:
            raise ConfigError(f"{self.label}: has no vocabulary: adapt it or give vocabulary=")

    # -- calling ----------------------------------------------------------------------------------

    def _depth_of(self, size: int) -> int:
        return self.max_tokens if self.pad_to_max_tokens else size

    def output_shape_for(self, input_shape):
        if self.output_mode == "int":
            return input_shape
        if not self.pad_to_max_tokens:
            self._known()
        depth = self._depth_of(self.vocabulary_size())
        if self.output_mode == "one_hot":
            return (*input_shape[:-1], depth) if input_shape[-1:] == (1,) else (*input_shape, depth)
        return (*input_shape[:-1], depth)

    def apply(self, x) -> np.ndarray:
        """The layer on data now: ids (int64), tokens (invert) or float32 encodings."""
        self._known()
        if self.invert:
            return self._invert(np.asarray(x))
        ids = self.lookup(self._tokens_of(x))
        return ids if self.output_mode == "int" else self.encode(ids)

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """Each token's index (int64, tokens' shape): the mask's 0 (int mode; dropped, -1,
        otherwise), an OOV index for a token not in the vocabulary."""
        self._known()
        flat = tokens.reshape(-1)
        # One dict lookup a token: TextVectorization's call, tokenizing included, took 1.57 s of CPU
        # for 5,000 texts of 230 words (1.4 us a token; IMDB's 25,000 reviews: about 8 s, once).
        get = self._index.get
        ids = np.fromiter((get(t, -1) for t in flat.tolist()), np.int64, flat.size)
        oov = ids < 0
        if self.mask_token is not None and oov.any():
            mask = oov & (flat == self.mask_token)
            ids[mask] = 0 if self.output_mode == "int" else -1
            oov &= ~mask
        if oov.any():
            if self.num_oov_indices == 0:
                raise ConfigError(f"{self.label}: {flat[np.argmax(oov)]!r} is not in the vocabulary and "
                                  "num_oov_indices=0")
            buckets = self._oov_bucket(flat[oov]) if self.num_oov_indices > 1 else 0
            ids[oov] = self._oov_start() + buckets
        return ids.reshape(tokens.shape)

    @abc.abstractmethod
    def _oov_bucket(self, tokens: np.ndarray) -> np.ndarray:
        """Which of the num_oov_indices buckets each out-of-vocabulary token goes to."""

    def encode(self, ids: np.ndarray) -> np.ndarray:
        """ids (-1: a dropped mask) as one_hot, multi_hot, count or tf_idf rows, float32: the
        last axis is a sample's (one_hot: each value its own, unless that axis is 1)."""
        depth = self._depth_of(self.vocabulary_size())
        if self.output_mode == "one_hot":
            lead = ids.shape[:-1] if ids.shape[-1:] == (1,) else ids.shape
            rows = ids.reshape(-1, 1)
        else:
            lead = ids.shape[:-1]
            rows = ids.reshape(-1, ids.shape[-1] if ids.ndim else 1)
        out = np.zeros((len(rows), depth), np.float32)
        r, c = np.nonzero(rows >= 0)
        np.add.at(out, (r, rows[r, c]), 1.0)
        if self.output_mode in ("one_hot", "multi_hot"):
            np.minimum(out, 1.0, out=out)
        elif self.output_mode == "tf_idf":
            out *= self.idf_weights[:depth]
        return out.reshape(*lead, depth)

    def _invert(self, ids: np.ndarray) -> np.ndarray:
        """Each index's token (the mask's at 0 in int mode, the OOV token at an OOV index or one
        beyond the vocabulary), as Keras's."""
        vocab = self.get_vocabulary()
        out = [vocab[i] if 0 <= i < len(vocab) else self.oov_token
               for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist()]
        kind = np.int64 if isinstance(self, IntegerLookup) else object
        return np.array(out, dtype=kind).reshape(np.shape(ids))

    # -- config -----------------------------------------------------------------------------------

    def get_config(self) -> dict:
        """The constructor's arguments with the vocabulary it holds now (adapted or given; for
        tf_idf with its special tokens first, beside its idf weights, one each): from_config makes
        the same lookup."""
        config = super().get_config()
        tf_idf = self.idf_weights is not None
        config["vocabulary"] = None if self._tokens is None else \
            [_plain(t) for t in self.get_vocabulary(include_special_tokens=tf_idf)]
        config["idf_weights"] = None if self.idf_weights is None else \
            self.idf_weights[:self.vocabulary_size()].tolist()
        return config


class StringLookup(IndexLookup):
    """Keras's StringLookup: strings (str, or bytes read as `encoding`) to indices."""

    kind = "string_lookup"

    def __init__(self, max_tokens=None, num_oov_indices=1, mask_token=None, oov_token="[UNK]",
                 vocabulary=None, idf_weights=None, invert=False, output_mode="int",
                 pad_to_max_tokens=False, sparse=False, encoding="utf-8", **kwargs):
        self.encoding = encoding
        super().__init__(max_tokens=max_tokens, num_oov_indices=num_oov_indices, mask_token=mask_token,
                         oov_token=oov_token, vocabulary=vocabulary, idf_weights=idf_weights, invert=invert,
                         output_mode=output_mode, sparse=sparse, pad_to_max_tokens=pad_to_max_tokens,
                         **kwargs)

    @property
    def input_dtype(self) -> str:
        return "int64" if self.invert else "str"

    def _token(self, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, bytes):
            return value.decode(self.encoding)
        if isinstance(value, np.str_):
            return str(value)
        raise ConfigError(f"{self.label}: {value!r} is not a string")

    def _tokens_of(self, values) -> np.ndarray:
        a = np.asarray(values)
        if a.dtype.kind == "U":
            return a.astype(object)
        if a.dtype.kind in "SO":
            return np.vectorize(self._token, otypes=[object])(a) if a.size else a.astype(object)
        raise ConfigError(f"{self.label}: takes strings, got an array of {a.dtype}")

    def _oov_bucket(self, tokens: np.ndarray) -> np.ndarray:
        # Keras hashes with FarmHash64; CRC-32 is as stable across processes (not Python's hash).
        return np.array([zlib.crc32(t.encode("utf-8")) % self.num_oov_indices for t in tokens.tolist()],
                        dtype=np.int64)


class IntegerLookup(IndexLookup):
    """Keras's IntegerLookup: int64 values to indices (OOV buckets by floormod, as Keras's)."""

    kind = "integer_lookup"
    input_dtype = "int64"

    def __init__(self, max_tokens=None, num_oov_indices=1, mask_token=None, oov_token=-1,
                 vocabulary=None, vocabulary_dtype="int64", idf_weights=None, invert=False,
                 output_mode="int", sparse=False, pad_to_max_tokens=False, **kwargs):
        if vocabulary_dtype != "int64":
            raise ConfigError(f"IntegerLookup: vocabulary_dtype must be 'int64' (as Keras), got "
                              f"{vocabulary_dtype!r}")
        super().__init__(max_tokens=max_tokens, num_oov_indices=num_oov_indices, mask_token=mask_token,
                         oov_token=oov_token, vocabulary=vocabulary, idf_weights=idf_weights, invert=invert,
                         output_mode=output_mode, sparse=sparse, pad_to_max_tokens=pad_to_max_tokens,
                         **kwargs)

    def _token(self, value):
        if value is None:
            return None
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            return int(value)
        raise ConfigError(f"{self.label}: {value!r} is not an integer")

    def _tokens_of(self, values) -> np.ndarray:
        a = np.asarray(values)
        if a.dtype.kind in "iu" or a.dtype.kind == "f" and np.all(np.floor(a) == a):
            return a.astype(np.int64)
        raise ConfigError(f"{self.label}: takes integers, got an array of {a.dtype}")

    def _oov_bucket(self, tokens: np.ndarray) -> np.ndarray:
        return np.mod(tokens.astype(np.int64), self.num_oov_indices)


class TextVectorization(Preprocessing):
    """Keras's TextVectorization: each string standardized, split into tokens (and their
    n-grams), then looked up (a StringLookup with mask_token='', as Keras's); output_mode "int"
    pads or cuts each sample's ids to output_sequence_length (in a model: give it)."""

    kind = "text_vectorization"

    def __init__(self, max_tokens=None, standardize="lower_and_strip_punctuation", split="whitespace",
                 ngrams=None, output_mode="int", output_sequence_length=None, pad_to_max_tokens=False,
                 vocabulary=None, idf_weights=None, sparse=False, ragged=False, encoding="utf-8", **kwargs):
        super().__init__(**kwargs)
        standardizers = (None, "lower_and_strip_punctuation", "lower", "strip_punctuation")
        for what, value, allowed in (("standardize", standardize, standardizers),
                                     ("split", split, (None, "whitespace", "character"))):
            if callable(value):
                raise ConfigError(f"TextVectorization: a callable {what} is not supported by pserver (give "
                                  f"one of {allowed}, or transform the strings before the layer)")
            if value not in allowed:
                raise ConfigError(f"TextVectorization: {what} must be one of {allowed}, got {value!r}")
        if ragged:
            raise ConfigError("TextVectorization: ragged=True is not supported by pserver (dense outputs "
                              "only)")
        self.ngrams = _ngrams(ngrams)
        mode = {"binary": "multi_hot", "tf-idf": "tf_idf"}.get(output_mode, output_mode)
        length = output_sequence_length
        if length is not None and (mode != "int" or not isinstance(length, int) or length < 1):
            raise ConfigError(f"TextVectorization: output_sequence_length={output_sequence_length!r}: a "
                              "positive integer, with output_mode='int' only")
        self.standardize, self.split, self.encoding = standardize, split, encoding
        self.output_sequence_length = output_sequence_length
        self.lookup_layer = StringLookup(max_tokens=max_tokens, mask_token="", vocabulary=vocabulary,
                                         idf_weights=idf_weights, output_mode=mode, sparse=sparse,
                                         pad_to_max_tokens=pad_to_max_tokens, encoding=encoding,
                                         name=f"{self.name or self.kind}_lookup")
        self.output_mode = self.lookup_layer.output_mode

    def tokens(self, text) -> list[str]:
        """One string's tokens, as Keras's standardize, split and ngrams make them."""
        text = self._standardized(text)
        if self.split is None:
            words = [text]
        elif self.split == "whitespace":
            words = [w for w in WHITESPACE.split(text) if w]
        else:
            words = list(text)
        if self.ngrams is None:
            return words
        return [" ".join(words[i:i + n]) for n in self.ngrams for i in range(len(words) - n + 1)]

    def _standardized(self, text) -> str:
        if isinstance(text, bytes):
            text = text.decode(self.encoding)
        elif not isinstance(text, str):
            raise ConfigError(f"{self.label}: takes strings, got {type(text).__name__}")
        if self.standardize in ("lower", "lower_and_strip_punctuation"):
            text = text.translate(ASCII_LOWER)
        if self.standardize in ("strip_punctuation", "lower_and_strip_punctuation"):
            text = PUNCTUATION.sub("", text)
        return text

    def _texts(self, x) -> list:
        """The strings of `x`: (n,) or (n, 1) when split, else any shape (flattened)."""
        a = np.asarray(x, dtype=object)
        if self.split is not None and a.ndim > 1:
            if a.shape[-1] != 1 or a.ndim > 2:
                raise ConfigError(f"{self.label}: to split strings it takes shape (n,) or (n, 1), got "
                                  f"{a.shape}")
            a = a[:, 0]
        return list(a.reshape(-1)) if a.ndim else [a.item()]

    def adapt(self, data, batch_size=None, steps=None) -> None:
        """The vocabulary from the texts of `data` (an array or list, or an iterable of batches),
        each string a document."""
        self._changing()
        texts = (t for batch in _batches(data, steps, self.label) for t in self._texts(batch))
        counts, docs, n_docs = collections.Counter(), collections.Counter(), 0
        for text in texts:
            tokens = self.tokens(text)
            counts.update(tokens)
            docs.update(set(tokens))
            n_docs += 1
        counts.pop("", None)
        counts.pop(self.lookup_layer.oov_token, None)
        self.lookup_layer._set_adapted(counts, docs, n_docs)

    def set_vocabulary(self, vocabulary, idf_weights=None) -> None:
        self._changing()
        self.lookup_layer.set_vocabulary(vocabulary, idf_weights)

    def get_vocabulary(self, include_special_tokens=True) -> list:
        return self.lookup_layer.get_vocabulary(include_special_tokens)

    def vocabulary_size(self) -> int:
        return self.lookup_layer.vocabulary_size()

    @property
    def _called(self) -> bool:
        return getattr(self.lookup_layer, "_called", False)

    @_called.setter
    def _called(self, value: bool) -> None:
        self.lookup_layer._called = value

    def output_shape_for(self, input_shape):
        if self.split is not None and (len(input_shape) > 1 or input_shape[-1:] not in ((), (1,))):
            raise ConfigError(f"{self.label}: splits strings: takes an input of shape (1,) (or ()), got "
                              f"{input_shape}")
        if self.output_mode == "int":
            if self.output_sequence_length is None:
                raise ConfigError(f"{self.label}: in a model, output_mode='int' needs output_sequence_length "
                                  "(pserver's tensors have fixed shapes)")
            return (self.output_sequence_length,)
        shape = self.lookup_layer.output_shape_for((1,))
        self.lookup_layer.output_shape = shape
        return shape

    def apply(self, x) -> np.ndarray:
        """Each string's ids, padded with 0 or cut to output_sequence_length (to the longest
        without it), or its encoding (its ids in a row padded with -1, which counts nothing)."""
        self.lookup_layer._known()
        docs = [self.tokens(t) for t in self._texts(x)]
        lengths = [len(d) for d in docs]
        ids = self.lookup_layer.lookup(np.array([t for d in docs for t in d], dtype=object))
        as_ids = self.output_mode == "int"
        width = self.output_sequence_length or max([*lengths, 0 if as_ids else 1])
        rows = _padded(ids, lengths, width, 0 if as_ids else -1)
        return rows if as_ids else self.lookup_layer.encode(rows)

    def get_config(self) -> dict:
        config = super().get_config()
        lookup = self.lookup_layer.get_config()
        config.update(vocabulary=lookup["vocabulary"], idf_weights=lookup["idf_weights"])
        return config


def _padded(ids: np.ndarray, lengths: list[int], width: int, fill: int) -> np.ndarray:
    """The rows of `ids` (one after another, `lengths` long) in a (rows, width) array, each cut
    to `width` or padded with `fill`."""
    rows = np.full((len(lengths), width), fill, np.int64)
    at = 0
    for r, n in enumerate(lengths):
        k = min(n, width)
        rows[r, :k] = ids[at:at + k]
        at += n
    return rows


def _checked_mode(owner: str, output_mode, invert, sparse, idf_weights) -> str:
    """output_mode by Keras's names (its old "binary" and "tf-idf" too), checked with the
    arguments that depend on it."""
    output_mode = {"binary": "multi_hot", "tf-idf": "tf_idf"}.get(output_mode, output_mode)
    if output_mode not in MODES:
        raise ConfigError(f"{owner}: output_mode must be one of {', '.join(MODES)}, got {output_mode!r}")
    if invert and output_mode != "int":
        raise ConfigError(f"{owner}: invert=True needs output_mode='int', got {output_mode!r}")
    if sparse:
        raise ConfigError(f"{owner}: sparse=True is not supported by pserver (dense outputs only)")
    if idf_weights is not None and output_mode != "tf_idf":
        raise ConfigError(f"{owner}: idf_weights is for output_mode='tf_idf'")
    return output_mode


def _batches(data, steps, label: str):
    """adapt's data as batches: an array or a list is one; an iterable gives them (`steps` of them)."""
    if isinstance(data, (np.ndarray, list, tuple, str, bytes)):
        if steps is not None:
            raise ConfigError(f"{label}: adapt: steps is for an iterable of batches, not arrays")
        yield np.asarray(data, dtype=object) if isinstance(data, (str, bytes)) else data
        return
    for i, batch in enumerate(data):
        if steps is not None and i >= steps:
            return
        yield batch


def _ngrams(ngrams) -> tuple[int, ...] | None:
    if ngrams is None:
        return None
    if isinstance(ngrams, int) and not isinstance(ngrams, bool) and ngrams >= 1:
        return tuple(range(1, ngrams + 1))
    if isinstance(ngrams, (tuple, list)) and ngrams and all(isinstance(n, int) and n >= 1 for n in ngrams):
        return tuple(ngrams)
    raise ConfigError(f"TextVectorization: ngrams must be None, an integer or a tuple of integers, got "
                      f"{ngrams!r}")


def _plain(token):
    return token.item() if isinstance(token, np.generic) else token


__all__ = ["IndexLookup", "IntegerLookup", "Preprocessing", "StringLookup", "TextVectorization"]
