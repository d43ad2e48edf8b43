"""The documentation's figures, drawn from the committed result files under bench/results/ (no
measuring here): training throughput, click-through rate, the reference CNN and elastic
workers. The pages under docs/ show them with this command beside each:

    .venv/bin/python bench/docs_figures.py                 # all four into docs/assets/figures/NAME.png
    .venv/bin/python bench/docs_figures.py --only ctr --out /tmp/figures

Needs matplotlib (the bench extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # _plots sits beside this file
import _plots  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def read(name: str):
    return json.loads((RESULTS / name).read_text())


def throughput(out: Path) -> None:
    runs = {f"run {i}": read(f"throughput/push-pull-run-{i}.json") for i in (1, 2, 3)}
    _plots.throughput_figure(out / "throughput.png", runs)


def ctr(out: Path) -> None:
    runs = {f"{model} {mode}": read(f"ctr/{model}_{mode}.json")
            for model in ("lr", "deepfm") for mode in ("sync", "async")}
    _plots.ctr_figure(out / "ctr.png", runs, read("ctr/wide_deep_vs_tf.json")["rounds"])


def cnn(out: Path) -> None:
    runs = {f"{mode} seed {seed}": read(f"cnn_mnist/{mode}-seed{seed}.json")
            for mode in ("sync", "async") for seed in (0, 1, 2)}
    _plots.curves_figure(out / "cnn.png", runs,
                         "--model cnn on MNIST: 2 shards, 4 workers, batch 64, Adam 0.001")


def elastic(out: Path) -> None:
    _plots.elastic_figure(out / "elastic.png", read("elastic/elastic.json"),
                          read("elastic/elastic_mnist.json"))


FIGURES = {"throughput": throughput, "ctr": ctr, "cnn": cnn, "elastic": elastic}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "figures",
                    help="directory for the PNGs (default: docs/assets/figures, which the pages show)")
    ap.add_argument("--only", choices=sorted(FIGURES), action="append",
                    help="draw this figure only (repeatable; default: all)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        FIGURES[name](args.out)
        print(f"{name}: written under {args.out}")


if __name__ == "__main__":
    main()
