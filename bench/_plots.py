"""The figures of bench/modes.py, drawn from its aggregated entries, and of bench/sparse.py
(matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")                  # files only: no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

ORDER = ("sync", "backup", "async", "ssp")


def sort_labels(labels) -> list[str]:
    """sync, backup-b1, backup-b2, async, ssp-s1, ssp-s4: families in ORDER, then by number."""
    def key(label):
        fam, _, rest = label.partition("-")
        return ORDER.index(fam) if fam in ORDER else len(ORDER), int(rest[1:] or 0) if rest else 0
    return sorted(set(labels), key=key)


def colours(entries: list[dict]) -> dict[str, tuple]:
    """One colour per mode label, the same in every figure."""
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(sort_labels(e["label"] for e in entries))}


def rank(colour: dict, item: dict) -> int:
    """Where item's mode label comes in the legend order."""
    return list(colour).index(item["label"])


def width(panels) -> float:
    """Figure width in inches: 5.2 per panel, and room for a two-line title with one."""
    return max(7.0, 5.2 * len(panels))


def profiles_at(entries: list[dict], n: int) -> list[str]:
    return list(dict.fromkeys(e["profile"] for e in entries if e["workers"] == n))


def curve_panel(ax, entries: list[dict], colour: dict, x: str) -> None:
    """Every repeat's curve, a mode's repeats in its colour, labelled once."""
    for e in sorted(entries, key=lambda e: rank(colour, e)):
        for i, run in enumerate(r for r in e["runs"] if r["ok"]):
            pts = run["curve"]
            ax.plot([p[x] for p in pts], [p["accuracy"] for p in pts], color=colour[e["label"]],
                    lw=1.4, alpha=0.9 if i == 0 else 0.45, marker=".", ms=3,
                    label=e["label"] if i == 0 else None)


def accuracy_figure(path: Path, entries: list[dict], n: int, args) -> None:
    """Test accuracy against wall time (top) and applied samples (bottom), a column per profile."""
    profiles, colour = profiles_at(entries, n), colours(entries)
    fig, axes = plt.subplots(2, len(profiles), figsize=(width(profiles), 8.6), squeeze=False, sharey=True)
    for j, profile in enumerate(profiles):
        group = [e for e in entries if e["workers"] == n and e["profile"] == profile]
        for i, (x, xlabel, mark) in enumerate((("seconds", "wall time (s)", args.budget),
                                               ("samples", "applied samples", args.samples))):
            ax = axes[i][j]
            curve_panel(ax, group, colour, x)
            ax.axhline(args.target, color="grey", ls="--", lw=0.8)
            ax.axvline(mark, color="grey", ls=":", lw=0.8)
            ax.set_xlabel(xlabel)
            ax.set_title(f"{profile}, N={n}" + (": statistical efficiency" if i else ""), fontsize=10)
            ax.grid(alpha=0.3)
    for ax in axes.flat:                 # the approach to the target, not the first seconds' climb
        ax.set_ylim(max(0.0, args.target - 0.15), 1.0)
    axes[0][0].set_ylabel("test accuracy (chief)")
    axes[1][0].set_ylabel("test accuracy (chief)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Test accuracy by consistency mode, N={n}\ndashed: target {args.target:g}; dotted: "
                 f"budget {args.budget:g} s (top), {args.samples:,} applied samples (bottom)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_figure(path: Path, entries: list[dict], scale: list[dict]) -> None:
    """Samples/s against N, median with min-max bars, and the fitted Amdahl curve (dashed)."""
    profiles, colour = list(dict.fromkeys(r["profile"] for r in scale)), colours(entries)
    ns = sorted({e["workers"] for e in entries})
    fig, axes = plt.subplots(1, len(profiles), figsize=(width(profiles), 4.8), squeeze=False)
    grid = np.geomspace(1, max(ns), 100)
    for ax, profile in zip(axes[0], profiles):
        rows = sorted((r for r in scale if r["profile"] == profile), key=lambda r: rank(colour, r))
        base = next((r["baseline_samples_per_s"] for r in rows if r["baseline_samples_per_s"]), None)
        if base:
            ax.plot(grid, base * grid, color="grey", lw=0.8, ls=":", label="ideal (x N)")
        for r in rows:
            pts, c, s = r["points"], colour[r["label"]], r["serial_fraction"]
            x = np.array([p["workers"] for p in pts])
            y = np.array([p["samples_per_s"] for p in pts])
            err = [y - [p["min"] for p in pts], [p["max"] for p in pts] - y]
            ax.errorbar(x, y, yerr=err, color=c, marker="o", ms=4, lw=0, elinewidth=1, capsize=3,
                        label=r["label"] + ("" if s is None else f" (s={s:.2f})"))
            if s is not None and base:
                ax.plot(grid, base / (s + (1 - s) / grid), color=c, ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("workers N")
        ax.set_title(f"{profile} (baseline {rows[0]['baseline'] if rows else '-'})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("train samples/s (median, min-max)")
    fig.suptitle("Throughput against N\ndashed: Amdahl fit, baseline x 1/(s + (1-s)/N)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def staleness_figure(path: Path, entries: list[dict], n: int) -> bool:
    """Share of applied pushes by staleness (async, ssp; all repeats pooled), a panel per profile."""
    stale = [e for e in entries if e["workers"] == n and e["mode"] in ("async", "ssp") and e["ok"]]
    if not stale:
        return False
    profiles, colour = list(dict.fromkeys(e["profile"] for e in stale)), colours(entries)
    fig, axes = plt.subplots(1, len(profiles), figsize=(width(profiles), 4.4), squeeze=False, sharey=True)
    for ax, profile in zip(axes[0], profiles):
        group = sorted((e for e in stale if e["profile"] == profile), key=lambda e: rank(colour, e))
        bar = 0.8 / len(group)
        for k, e in enumerate(group):
            hist = np.sum([r["staleness_histogram"] for r in e["runs"] if r["ok"]], axis=0)
            share = hist / max(hist.sum(), 1)
            x = np.arange(len(share))
            ax.bar(x + (k - (len(group) - 1) / 2) * bar, share, bar, color=colour[e["label"]],
                   label=f"{e['label']} (mean {e['metrics']['staleness_mean']['median']:.2f})")
        ticks = list(range(len(share)))
        ax.set_xticks(ticks, [str(t) for t in ticks[:-1]] + [f">={ticks[-1]}"], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("staleness (versions behind when applied)")
        ax.set_title(f"{profile}, N={n}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("share of applied pushes")
    fig.suptitle(f"Staleness of applied pushes, N={n} (all repeats pooled)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw_all(out: Path, entries: list[dict], scale: list[dict], n: int | None, args) -> list[str]:
    """Draw what the entries allow; the names of the files written."""
    done = [e for e in entries if e["ok"]]
    if not done or n is None:
        return []
    written = []
    accuracy_figure(out / "accuracy.png", done, n, args)
    written.append("accuracy.png")
    scaling_figure(out / "scaling.png", done, scale)
    written.append("scaling.png")
    if staleness_figure(out / "staleness.png", done, n):
        written.append("staleness.png")
    return written


def sparse_figure(path: Path, results: list[dict], baseline: float, args, target: float = 10e6) -> None:
    """Rows/s against shard count, pull and push side by side: a line per plane (median,
    min-max bars), np.add.at's rows/s dashed and the 10M rows/s target dotted."""
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.6), sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, op in zip(axes, ("pull", "push")):
        for i, plane in enumerate(dict.fromkeys(r["plane"] for r in results)):
            pts = sorted((r["shards"], r["rows_per_s"]) for r in results
                         if r["plane"] == plane and r["op"] == op)
            xs = [s for s, _ in pts]
            med = np.array([np.median(v) for _, v in pts]) / 1e6
            err = [med - np.array([min(v) for _, v in pts]) / 1e6,
                   np.array([max(v) for _, v in pts]) / 1e6 - med]
            ax.errorbar(xs, med, yerr=err, color=cmap(i), marker="o", capsize=3, label=plane)
        ax.axhline(baseline / 1e6, color="grey", ls="--", lw=0.9, label="np.add.at (in process)")
        ax.axhline(target / 1e6, color="grey", ls=":", lw=0.9, label=f"target {target / 1e6:g}M rows/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["shards"] for r in results}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        ax.set_xlabel("shards")
        ax.set_title({"pull": "row pulls", "push": "row pushes (adagrad applied)"}[op], fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("million distinct rows / s (all shards)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Sparse rows through pserver's client and shards: dim {args.dim}, adagrad, "
                 f"{args.rows:,} rows and {args.ids:,} ids per shard per request", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- The documentation's figures (bench/docs_figures.py), each drawn from committed result files --

def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bars(ax, groups: list[str], series: dict[str, list[tuple]], unit: float = 1.0) -> None:
    """Grouped bars: for each series name, one (value, low, high) per group; low/high as error bars
    (nan: none)."""
    cmap, width = plt.get_cmap("tab10"), 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, points) in enumerate(series.items()):
        v, lo, hi = (np.array(c, dtype=float) / unit for c in zip(*points))
        err = None if np.isnan(lo).all() else np.nan_to_num(np.array([v - lo, hi - v]), nan=0.0)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, v, width, yerr=err, capsize=3, color=cmap(i),
               label=name)
    ax.set_xticks(x, groups)
    ax.grid(alpha=0.3, axis="y")


def throughput_figure(path: Path, runs: dict[str, list[dict]]) -> None:
    """bench/throughput.py's rows, a run each: samples/s per mode, median with min-max bars."""
    modes = list(dict.fromkeys(r["mode"] for rows in runs.values() for r in rows))
    series = {name: [next(((r["train_samples_per_second"], r["min"], r["max"]) for r in rows
                           if r["mode"] == m), (np.nan,) * 3) for m in modes]
              for name, rows in runs.items()}
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    bars(ax, [m.replace("_", " ") for m in modes], series, unit=1e3)
    ax.set_ylabel("train samples/s, thousands (median, min-max)")
    ax.legend(fontsize=8)
    ax.set_title("bench/throughput.py: 1 shard + 2 workers on 2 cores, MLP 784-256-256-10, batch 256",
                 fontsize=10)
    save(fig, path)


def ctr_figure(path: Path, runs: dict[str, dict], rounds: list[dict]) -> None:
    """Test AUC and samples/s of the CTR runs (left, middle), and wide_deep against TensorFlow's
    ParameterServerStrategy per round (right)."""
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 4.2))
    names = list(runs)
    # Points, not bars: the AUCs differ in the third decimal, which bars from 0 would hide.
    axes[0].plot(names, [r["per_epoch"][-1]["auc"] for r in runs.values()], "o", ms=7, label="test AUC")
    best = next(iter(runs.values()))["best_auc"]
    axes[0].axhline(best, color="grey", ls="--", lw=0.9, label=f"the planted model ({best:.4f})")
    axes[0].set_ylim(0.85, 0.90)
    axes[0].grid(alpha=0.3, axis="y")
    axes[0].set_title("test AUC, 1M samples, 2 shards, 4 workers", fontsize=10)
    axes[0].legend(fontsize=8, loc="lower right")
    bars(axes[1], names, {"samples/s": [(r["train_samples_per_second"], np.nan, np.nan)
                                        for r in runs.values()]}, unit=1e3)
    axes[1].set_title("train samples/s, thousands", fontsize=10)
    bars(axes[2], [f"round {r['round']}" for r in rounds],
         {"TensorFlow PSS": [(r["tensorflow"]["train_samples_per_second"], np.nan, np.nan) for r in rounds],
          "pserver sync": [(r["pserver"]["train_samples_per_second"], np.nan, np.nan) for r in rounds]},
         unit=1e3)
    axes[2].set_title("wide_deep, 1 ps + 2 workers: samples/s, thousands", fontsize=10)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    save(fig, path)


def curves_figure(path: Path, runs: dict[str, dict], title: str) -> None:
    """Test accuracy after each epoch (a summary's per_epoch), a line per run, a colour per mode."""
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    cmap, modes = plt.get_cmap("tab10"), list(dict.fromkeys(r["mode"] for r in runs.values()))
    seen: dict[str, int] = {}
    for name, r in runs.items():
        pts, k = r["per_epoch"], seen.setdefault(r["mode"], 0)
        seen[r["mode"]] += 1
        ax.plot([p["epoch"] for p in pts], [p["accuracy"] for p in pts], marker="o", ms=3, lw=1.2,
                color=cmap(modes.index(r["mode"])), ls=("-", "--", ":", "-.")[k % 4], label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_xticks(sorted({p["epoch"] for r in runs.values() for p in r["per_epoch"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title, fontsize=10)
    save(fig, path)


def elastic_figure(path: Path, growth: dict, mnist: dict) -> None:
    """bench/elastic.py's pairs (left: samples/s grown from 2 to 4 workers against 4 from the
    start) and bench/elastic_mnist.py's runs (right: test accuracy of each run, grown and from
    the start, per mode)."""
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2))
    pairs = growth["pairs"]
    bars(axes[0], [f"pair {i + 1}" for i in range(len(pairs))],
         {"grown 2 -> 4": [(p["grown"]["samples_per_s"], np.nan, np.nan) for p in pairs],
          "4 from the start": [(p["started_with_4"]["samples_per_s"], np.nan, np.nan) for p in pairs]},
         unit=1e3)
    axes[0].set_ylabel("train samples/s, thousands")
    axes[0].set_title(f"bench/elastic.py (median ratio {growth['median_ratio']:.2f})", fontsize=10)
    axes[0].legend(fontsize=8, loc="lower right")
    cmap = plt.get_cmap("tab10")
    for i, (mode, entry) in enumerate(mnist["modes"].items()):
        for j, kind in enumerate(("grown", "from_start")):
            acc = [r["test_accuracy"] for r in entry[kind]]
            x = 2 * i + j
            axes[1].scatter([x] * len(acc), acc, color=cmap(j), zorder=3,
                            label=kind.replace("_", " ") if i == 0 else None)
            axes[1].hlines(entry["median_accuracy"][kind], x - 0.25, x + 0.25, color=cmap(j))
    axes[1].set_xticks(range(2 * len(mnist["modes"])),
                       [f"{m}\n{k}" for m in mnist["modes"] for k in ("grown", "from start")])
    axes[1].set_ylabel("test accuracy (runs; line: median)")
    axes[1].set_title("bench/elastic_mnist.py: 2 workers, 2 join, 1 killed", fontsize=10)
    axes[1].grid(alpha=0.3, axis="y")
    axes[1].legend(fontsize=8)
    save(fig, path)
