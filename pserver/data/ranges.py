"""Byte ranges of a file of lines, as Hadoop splits files: the range [a, b) owns the lines that
*start* in it. A reader of [a, b) skips to the first line that starts at or after a (the byte
before it is a newline) and reads on past b to the end of the last line that starts before b.
Ranges that tile [0, length) therefore give every line exactly once, whatever the line lengths:
a line longer than a range belongs to the range it starts in, and a range in which no line
starts gives none.

    open_lines(path)            -> LineFile   (plain, or gzip told by its first bytes)
    LineFile.lines_in(a, b)     -> (offset of its first line, the bytes of its lines)

A gzip file is read through a seek index (indexed_gzip: a checkpoint of the decompressor every
GZIP_SPACING bytes of output), so a range is read without decompressing from the start. The
index is built once, on the first open, and kept in the cache directory
($XDG_CACHE_HOME/pserver/gzindex) with what it was built from (the compressed file's size and a
hash of its first and last bytes); a file that has changed since is refused, naming both. Offsets
are in the decompressed text.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib

from pserver.errors import DataError

MAX_LINE_BYTES = 1 << 20   # a longer line means the file is not a line file we read (and would fill memory)
READ_BYTES = 1 << 16       # read this much at a time while looking for a newline
GZIP_SPACING = 4 << 20     # decompressed bytes between two checkpoints of a gzip file's seek index
IDENTITY_BYTES = 1 << 16   # a file's identity: its size and a hash of this many bytes at each end
GZIP_MAGIC = b"\x1f\x8b"


class LineFile:
    """A file of lines that can be read a byte range at a time (the text's offsets)."""

    def __init__(self, path: str, f, length: int, max_line: int = MAX_LINE_BYTES) -> None:
        self.path, self.f, self.length, self.max_line = path, f, length, max_line

    def lines_in(self, a: int, b: int) -> tuple[int, bytes]:
        """The lines that start in [a, b): (where the first starts, their bytes, each with its
        newline except the file's last line when the file does not end in one)."""
        a, b = max(0, a), min(b, self.length)
        if a >= b:
            return b, b""
        start = 0 if a == 0 else self._after_newline(a - 1, b)
        if start >= b:
            return b, b""
        data = self._read_at(start, b - start)
        if not data.endswith(b"\n") and start + len(data) < self.length:
            data += self._to_newline(start + len(data), start + data.rfind(b"\n") + 1)
        return start, data

    def _read_at(self, at: int, n: int) -> bytes:
        try:
            self.f.seek(at)
            data = self.f.read(n)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{self.path}: cannot read at byte {at} ({_reason(e)})") from None
        if len(data) != n:
            raise DataError(f"{self.path}: {n} bytes at byte {at} are past its end ({self.length} bytes "
                            "when opened): the file changed while it was read")
        return data

    def _after_newline(self, at: int, limit: int) -> int:
        """Where the first line that starts after byte `at` starts, or `limit` when none starts
        before it (the bytes up to `limit` are all that is read)."""
        p = at
        while p < limit:
            block = self._read_at(p, min(READ_BYTES, limit - p))
            k = block.find(b"\n")
            if k >= 0:
                return p + k + 1
            p += len(block)
        return limit

    def _to_newline(self, at: int, line_start: int) -> bytes:
        """The bytes from `at` through the next newline (or the end of the file), the rest of the
        line that starts at `line_start`."""
        parts, p = [], at
        while p < self.length:
            block = self._read_at(p, min(READ_BYTES, self.length - p))
            k = block.find(b"\n")
            if k >= 0:
                block = block[:k + 1]
            parts.append(block)
            p += len(block)
            if p - line_start > self.max_line:
                self._too_long(line_start)
            if k >= 0:
                break
        return b"".join(parts)

    def _too_long(self, at: int):
        raise DataError(f"{self.path}: the line at byte {at} is longer than {self.max_line} bytes: "
                        "not a file of text lines")

    def close(self) -> None:
        self.f.close()


def open_lines(path: str, cache_dir: str | None = None, max_line: int = MAX_LINE_BYTES) -> LineFile:
    """`path` as a LineFile: plain, or gzip (its seek index built once and cached)."""
    try:
        with open(path, "rb") as raw:
            gz = raw.read(2) == GZIP_MAGIC
        if not gz:
            return LineFile(path, open(path, "rb"), os.path.getsize(path), max_line)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({_reason(e)})") from None
    import indexed_gzip  # only for a .gz file's leases
    index, length = gzip_index(path, cache_dir)
    try:
        f = indexed_gzip.IndexedGzipFile(path, index_file=index, spacing=GZIP_SPACING)
    except (OSError, ValueError, indexed_gzip.ZranError) as e:
        raise DataError(f"{path}: cannot read with its seek index {index} ({_reason(e)}); delete the index "
                        "to build it again") from None
    return LineFile(path, f, length, max_line)


def default_cache_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pserver", "gzindex")


def identity(path: str) -> dict:
    """What a file is, cheaply: its size and a hash of its first and last IDENTITY_BYTES."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(IDENTITY_BYTES))
        f.seek(max(0, size - IDENTITY_BYTES))
        h.update(f.read(IDENTITY_BYTES))
    return {"size": size, "sha256_ends": h.hexdigest()}


def gzip_index(path: str, cache_dir: str | None = None) -> tuple[str, int]:
    """The seek index of gzip file `path` (built now if there is none) and the length of its text.
    Building checks the whole stream first (gzip's CRC and length trailer), so a truncated or
    corrupt file is refused before any worker trains on part of it."""
    import indexed_gzip
    cache_dir = cache_dir or default_cache_dir()
    real = os.path.realpath(path)
    key = f"{os.path.basename(real)}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"
    index, meta_path = os.path.join(cache_dir, key + ".gzidx"), os.path.join(cache_dir, key + ".json")
    try:
        now = identity(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({_reason(e)})") from None
    if os.path.exists(meta_path) and os.path.exists(index):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            built, length = meta["identity"], int(meta["length"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path}: not a seek index description ({_reason(e)}); delete it and "
                            f"{index} to build the index of {path} again") from None
        if built != now:
            raise DataError(f"{path} changed since its seek index {index} was built (size "
                            f"{built.get('size')} then, {now['size']} now, or other first/last bytes); "
                            f"delete {index} and {meta_path} to build it again")
        return index, length
    length = _checked_length(path)
    try:
        f = indexed_gzip.IndexedGzipFile(path, spacing=GZIP_SPACING)
        try:
            f.build_full_index()
            f.seek(0, os.SEEK_END)
            if f.tell() != length:
                raise DataError(f"{path}: its seek index reaches byte {f.tell()} of {length}: a gzip file "
                                "this reader cannot index")
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{index}.{os.getpid()}.tmp"
            f.export_index(tmp)
        finally:
            f.close()
        os.replace(tmp, index)
        tmp = f"{meta_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as out:
            json.dump({"path": real, "identity": now, "length": length, "spacing": GZIP_SPACING}, out)
        os.replace(tmp, meta_path)
    except (OSError, indexed_gzip.ZranError) as e:
        raise DataError(f"{path}: cannot build its seek index in {cache_dir} ({_reason(e)})") from None
    return index, length


def _checked_length(path: str) -> int:
    """The length of a gzip file's text, read through once: gzip's trailer checks every member
    (its CRC and length), so a cut or corrupt file fails here in one line."""
    n = 0
    try:
        with gzip.open(path, "rb") as f:
            while block := f.read(4 << 20):
                n += len(block)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a whole gzip file ({_reason(e)})") from None
    return n


def _reason(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
