"""A py-spy raw profile of a `pserver launch` (bench/gpu_check.sh's profile step: `py-spy record
--subprocesses --idle --format raw`) as a short text: per worker, where its training loop's time
went (frames under pserver.worker.loop.train, as shares of that time, and the innermost frames);
per shard, the frames of its busy samples (waits on sockets, locks and accept left out).

    python bench/spy_summary.py PROFILE.txt [--rate 200] [--top 25] > SUMMARY.txt
"""

from __future__ import annotations

import argparse
import collections

IDLE = ("recv_exact", "Condition.wait", "_reap", "grpc/_server.py", "socket.accept", "thread.py:89")
PLUMBING = ("threading.py", "_bootstrap", "runpy", "child.py", "roles.py")


def processes(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """Each process's stacks (below its 'process PID:"command"' frame) with their sample counts."""
    out = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            frames = stack.split(";")
            at = max(i for i, fr in enumerate(frames) if fr.startswith("process "))
            out[frames[at]].append((frames[at + 1:], int(n)))
    return out


def shares(rows, keep) -> tuple[int, collections.Counter, collections.Counter]:
    total, inclusive, leaves = 0, collections.Counter(), collections.Counter()
    for frames, n in rows:
        if not frames or not keep(frames):
            continue
        total += n
        for fr in set(frames):
            inclusive[fr] += n
        leaves[frames[-1]] += n
    return total, inclusive, leaves


def ranked(counts: collections.Counter) -> list[tuple[str, int]]:
    """Most samples first; ties by name, so that a summary is the same each time."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--rate", type=float, default=200, help="py-spy's --rate (samples per second)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(f"py-spy raw profile {args.profile}, {args.rate:g} samples/s\n")
    for proc, rows in processes(args.profile).items():
        if "child worker" in proc:
            what = "its training loop (frames under pserver.worker.loop.train)"
            in_train = "train (pserver/worker/loop.py"
            total, inclusive, leaves = shares(rows, lambda fr: any(f.startswith(in_train) for f in fr))
        elif "child serve" in proc:
            what = "its busy samples (waits on sockets, locks and accept left out)"
            total, inclusive, leaves = shares(rows, lambda fr: not any(s in fr[-1] for s in IDLE)
                                              and not any("<module>" in f for f in fr))
        else:
            continue
        if not total:
            continue
        print(f"== {proc[:110]}\n   {what}: {total / args.rate:.3f} s")
        for fr, n in ranked(inclusive)[:args.top]:
            if not any(p in fr for p in PLUMBING):
                print(f"   {n / total:6.1%}  {fr[:120]}")
        print("   innermost frames:")
        for fr, n in ranked(leaves)[:8]:
            print(f"   {n / total:6.1%}  {fr[:120]}")
        print()


if __name__ == "__main__":
    main()
