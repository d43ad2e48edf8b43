"""What verifying an export's files costs when a model is opened, and the alternative: by pages.

    python bench/export_verify.py --rows 4_000_000 --dim 16 --repeats 5

Writes one table of --rows ids x --dim float32 rows as `pserver export` does (pserver.persist.model_file:
its files hashed as they are written) and opens its tables, interleaved --repeats times:
  map         np.load(mmap_mode="r") of ids and rows, dtypes and shapes checked: what opening
              did before exports carried checksums
  unverified  read_tables of the model with "files" removed from its JSON (an export written
              before checksums): map + ids checked strictly ascending (a pass over the ids)
  verified    read_tables as it is: every file's sha256 read whole, then map + ids ascending
(and the sha256 of each file alone, and zlib's CRC-32 of the rows, a cheaper checksum, for scale)
each warm (the files in the page cache, as just written) and cold (the files' pages dropped
from the cache with posix_fadvise(DONTNEED) first: this bench's files only).
By pages (the alternative): a digest per CHUNK bytes of the rows, each checked the first time a
lookup touches it. The ids must be read whole at open anyway (the ascending check, and a binary
search reads pages across the whole file), so its start-up is `unverified` + the ids' hash; the
rows' hashing moves to the first lookups: for batches of --batch random held ids, the share of
the rows' chunks the first batch touches (what the first request would hash) and the batches
until 90% of them are touched.
JSON: results/ctr/export-verify.json (or --json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, machine_lines, result_path  # noqa: E402
from export import TableModel  # noqa: E402  (bench/export.py: a dense layout and one table)

from pserver.persist import model_file as saved  # noqa: E402
from pserver.sparse import TableConfig  # noqa: E402


def evict(files: list[str]) -> None:
    """These files' pages dropped from the page cache (they are clean: written and fsynced)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mapped(path: str, meta: dict) -> None:
    """Opening as it was before checksums: map, check dtypes and shapes."""
    for entry in meta["tables"]:
        ids = np.load(os.path.join(path, "tables", f"{entry['name']}.ids.npy"), mmap_mode="r")
        rows = np.load(os.path.join(path, "tables", f"{entry['name']}.rows.npy"), mmap_mode="r")
        assert ids.dtype == np.uint64 and ids.shape == (entry["rows"],) and rows.shape == (entry["rows"],
                                                                                         entry["dim"])


def sha256_seconds(file: str) -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(file, "rb", buffering=0) as f:
        while chunk := f.read(saved.HASH_CHUNK):
            h.update(chunk)
    return time.perf_counter() - t


def crc32_seconds(file: str) -> float:
    """zlib's CRC-32 of the file: the cheaper checksum, for comparison."""
    t, crc = time.perf_counter(), 0
    with open(file, "rb", buffering=0) as f:
        while chunk := f.read(saved.HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return time.perf_counter() - t


def by_pages(rows: int, dim: int, batch: int, chunk: int, rng) -> dict:
    """The rows' chunks that batches of random held ids touch: the first batch's share, and the
    batches until 90% are touched."""
    row_bytes = dim * 4
    chunks = -(-rows * row_bytes // chunk)
    seen = np.zeros(chunks, bool)
    first, batches = None, 0
    while seen.mean() < 0.9 and batches < 100_000:
        pos = rng.integers(0, rows, batch)
        seen[np.unique(pos * row_bytes // chunk)] = True
        batches += 1
        if first is None:
            first = float(seen.mean())
    return {"chunk_bytes": chunk, "chunks": int(chunks), "digest_bytes": int(chunks) * 32,
            "first_batch_share": first, "batches_to_90pct": batches}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512, help="ids per lookup batch (by pages)")
    ap.add_argument("--json", default=None, help="default results/ctr/export-verify.json")
    args = ap.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)), flush=True)
    logging.getLogger("pserver.model").setLevel(logging.ERROR)     # "unverified", once per open
    rng = np.random.default_rng(0)
    table = TableConfig("emb", args.dim, optimizer="sgd", lr=0.01)
    model = TableModel(table)
    ids = np.sort(rng.choice(np.uint64(1) << np.uint64(40), args.rows, replace=False).astype(np.uint64))
    rows = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    times: dict = {k: [] for k in ("write", "map warm", "unverified warm", "verified warm", "map cold",
                                   "unverified cold", "verified cold", "sha256 ids", "sha256 rows",
                                   "crc32 rows")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        out = os.path.join(work, "model")
        for _ in range(args.repeats):
            t = time.perf_counter()
            saved.save(out, model, np.zeros(1, np.float32), None, {},
                       tables={"emb": saved.TableRows(args.rows, iter([(ids, rows)]))})
            times["write"].append(time.perf_counter() - t)
            meta, _ = saved.read(out)
            old = {k: v for k, v in meta.items() if k != saved.FILES}
            files = [os.path.join(out, "tables", f"emb.{w}.npy") for w in ("ids", "rows")]
            times["sha256 ids"].append(sha256_seconds(files[0]))
            times["sha256 rows"].append(sha256_seconds(files[1]))
            times["crc32 rows"].append(crc32_seconds(files[1]))
            for cache in ("warm", "cold"):
                for label, open_ in (("map", lambda: mapped(out, meta)),
                                     ("unverified", lambda: saved.read_tables(out, old)),
                                     ("verified", lambda: saved.read_tables(out, meta))):
                    if cache == "cold":
                        evict(files)
                    else:
                        open_()             # in the cache
                    t = time.perf_counter()
                    open_()
                    times[f"{label} {cache}"].append(time.perf_counter() - t)
        size = {w: os.path.getsize(f) for w, f in zip(("ids", "rows"), files)}
    med = {k: statistics.median(v) for k, v in times.items()}
    pages = [by_pages(args.rows, args.dim, args.batch, c, rng) for c in (1 << 16, 1 << 20)]
    mib = 1 << 20
    print(f"{args.rows:,} rows x {args.dim}: ids {size['ids'] / mib:.0f} MiB, rows {size['rows'] / mib:.0f} "
          f"MiB; medians of {args.repeats} interleaved")
    print(f"write (save, hashed as written) {med['write']:.3f} s; sha256 alone: ids {med['sha256 ids']:.3f} "
          f"s, rows {med['sha256 rows']:.3f} s (CRC-32 of the rows: {med['crc32 rows']:.3f} s)")
    for cache in ("warm", "cold"):
        print(f"open {cache}: map only (before) {med[f'map {cache}'] * 1e3:.1f} ms, unverified (map + ids "
              f"ascending) {med[f'unverified {cache}'] * 1e3:.1f} ms, verified whole (sha256 + map + ids "
              f"ascending) {med[f'verified {cache}'] * 1e3:.1f} ms")
    lazy = med["unverified warm"] + med["sha256 ids"]
    print(f"by pages: start-up (ids hashed and checked whole) {lazy * 1e3:.1f} ms warm; the rows' hash "
          f"({med['sha256 rows'] * 1e3:.0f} ms) moves to the first lookups:")
    for p in pages:
        first_ms = p["first_batch_share"] * med["sha256 rows"] * 1e3
        print(f"  chunks of {p['chunk_bytes'] // 1024} KiB ({p['chunks']:,} digests, "
              f"{p['digest_bytes'] / 1024:,.0f} KiB): the first batch of {args.batch} ids touches "
              f"{p['first_batch_share']:.0%} of them (~{first_ms:.0f} ms of hashing in that request); 90% "
              f"after {p['batches_to_90pct']} batches")
    result = {"command": "python bench/export_verify.py " + " ".join(sys.argv[1:]),
              "rows": args.rows, "dim": args.dim, "bytes": size, "seconds": times, "median": med,
              "by_pages": pages, "batch": args.batch, "machine": m,
              "load_avg_1m_end": round(os.getloadavg()[0], 2)}
    print(f"load average (1 min) at the end: {result['load_avg_1m_end']}")
    path = result_path(args.json, "ctr/export-verify.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
