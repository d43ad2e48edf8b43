"""The bench scripts as a user runs them: real launches, small grids, output where it belongs."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import missing

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# One tiny configuration: sync, 1 worker, a few hundred synthetic samples.
GRID = ["--quick", "--workers", "1", "--modes", "sync", "--profiles", "none", "--epochs", "1"]
SMALL = ["--", "--samples", "2000", "--test-samples", "500"]   # flags for every launch


def bench(script: str, *args: str, cwd: Path, env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def without_matplotlib(tmp_path: Path) -> dict:
    """An environment where `import matplotlib` fails, as on an install without the bench extra."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    return {"PYTHONPATH": f"{shadow.parent}:{ROOT}"}


def test_modes_without_matplotlib_stops_before_running_anything(tmp_path):
    out = tmp_path / "out"
    r = bench("modes.py", *GRID, "--out", str(out), cwd=tmp_path, env=without_matplotlib(tmp_path))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and 'pip install -e ".[bench]"' in lines[0]
    assert "--no-plots" in lines[0] and "Traceback" not in r.stderr
    assert not out.exists()           # not one launch ran


def test_modes_no_plots_writes_results_and_replot_needs_matplotlib(tmp_path):
    out = tmp_path / "results" / "modes"      # the default: under the directory it runs in
    r = bench("modes.py", *GRID, "--no-plots", *SMALL, cwd=tmp_path, env=without_matplotlib(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    [entry] = result["configs"]
    assert (entry["mode"], entry["workers"], entry["ok"]) == ("sync", 1, True)
    assert (out / "summary.md").is_file() and not list(out.glob("*.png"))
    # A finished run can be redrawn later; without matplotlib that says so in one line.
    r = bench("modes.py", "--replot", "--out", str(out), cwd=tmp_path, env=without_matplotlib(tmp_path))
    assert r.returncode != 0 and "matplotlib" in r.stderr and "Traceback" not in r.stderr
    r = bench("modes.py", "--replot", "--no-plots", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0 and json.loads((out / "results.json").read_text())["configs"] == [entry]


def test_throughput_writes_to_the_users_results_directory_not_the_committed_one(tmp_path):
    committed = (ROOT / "bench" / "results" / "throughput.json").read_bytes()
    r = bench("throughput.py", "--modes", "sync", "--repeats", "1", "--epochs", "1", "--seconds", "1",
              "--no-tf", "--", "--samples", "2048", "--test-samples", "256", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {row["mode"]: row for row in json.loads((tmp_path / "results" / "throughput.json").read_text())}
    assert sorted(rows) == ["compute_bound", "sync"], sorted(rows)
    row = rows["sync"]
    assert row["steps"] == 4 and row["train_samples_per_second"] > 0
    assert rows["compute_bound"]["train_samples_per_second"] > 0
    assert f"wrote {Path('results') / 'throughput.json'}" in r.stdout
    assert (ROOT / "bench" / "results" / "throughput.json").read_bytes() == committed


def test_transport_two_hosts_row_measures_pserver_and_iperf3_on_the_same_veth(tmp_path):
    """The opt-in row: a shard in one network namespace, the client in another, and iperf3
    between them; both figures land in the JSON and the namespaces are gone afterwards."""
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in ("ip", "tc", "iperf3")):
        missing("the two-host transport row", "--two-hosts needs root, ip, tc and iperf3")
    r = bench("transport.py", "--systems", "tcp", "--sizes", "1000", "--repeats", "1", "--two-hosts",
              "--json", str(tmp_path / "t.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    [row] = [x for x in json.loads((tmp_path / "t.json").read_text()) if x["variant"] == "two-hosts"]
    assert row["params"] == 10_000_000 and row["value"] > 0 and row["iperf3_mb_per_s"] > 0
    assert row["x_link_rate"] == pytest.approx(row["value"] / row["iperf3_mb_per_s"])
    assert "x the link rate" in r.stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert len(row["namespaces"]) == 2 and not set(row["namespaces"]) & set(listed), (row, listed)
    # (its own: another run on this machine, a CI beside a quick start, may hold pst- ones now)


def test_compress_summary_takes_medians_and_counts_a_miss_as_slowest():
    """The compress bench's figures: per link and codec the median over repeats, a run that
    never reached the target slower than any that did, speedup = none's median / the codec's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import compress

    def run(codec, t, acc, repeat):
        return {"link": "1gbit", "codec": codec, "time_to_target_s": t, "final_accuracy": acc,
                "run_wall_s": 10.0 + repeat, "repeat": repeat}
    rows = [run("none", t, a, i) for i, (t, a) in enumerate([(30.0, 0.96), (None, 0.95), (20.0, 0.97)])]
    rows += [run("bf16", t, a, i) for i, (t, a) in enumerate([(10.0, 0.962), (14.0, 0.961), (None, 0.96)])]
    rows += [run("sign", t, 0.9, i) for i, t in enumerate([None, None, 8.0])]
    s = {r["codec"]: r for r in compress.summarize(rows)}
    assert s["none"]["time_to_target_s"] == 30.0 and s["bf16"]["time_to_target_s"] == 14.0
    assert s["none"]["final_accuracy"] == 0.96 and s["bf16"]["final_accuracy"] == 0.961
    assert s["bf16"]["speedup"] == pytest.approx(30.0 / 14.0)
    assert s["bf16"]["pp_vs_none"] == pytest.approx(0.1)
    assert s["sign"]["time_to_target_s"] is None and s["sign"]["speedup"] is None   # 2 of 3 missed
    assert s["bf16"]["times_to_target_s"] == [10.0, 14.0, None] and s["none"]["repeats"] == 3
    r = bench("compress.py", "--repeats", "0", cwd=ROOT)
    assert r.returncode == 2 and "--repeats: must be >= 1" in r.stderr


def test_pool_seeds_reproduces_the_committed_30_seed_record_and_pairs_only_seeds_both_sides_ran(tmp_path):
    """bench/keras_io/pool_seeds.py over the committed result files prints the committed record
    (bench/results/keras_io/toy_resnet-60000samples-1ep-30-seeds.txt, whose first lines are its
    command): fails if a figure in the docs no longer follows from the files. A later file's run of
    a seed replaces an earlier one's, and a seed only one side ran is left out and named."""
    record = (ROOT / "bench/results/keras_io/toy_resnet-60000samples-1ep-30-seeds.txt").read_text()
    command = shlex.split(record.split("\n(")[0].removeprefix("$ ").replace("\\\n", " "))
    assert command[:2] == [".venv/bin/python", "bench/keras_io/pool_seeds.py"], command
    r = bench("keras_io/pool_seeds.py", *command[2:], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == record.split(")\n", 1)[1], r.stdout
    old, new = tmp_path / "old.log", tmp_path / "new.log"
    line = "toy_resnet {} seed {}: test accuracy {}\n".format
    old.write_text(line("pserver", 1, 0.5) + line("keras", 1, 0.6) + line("pserver", 2, 0.9)
                   + line("keras", 3, 0.9))
    new.write_text(line("pserver", 1, 0.7) + "other pserver seed 2: test accuracy 0.1\n")
    r = bench("keras_io/pool_seeds.py", "--script", "toy_resnet", "--setting", "x", str(old), str(new),
              cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "1 seeds both sides ran (1-1); left out, one side only: keras 3, pserver 2" in r.stdout, r.stdout
    assert "medians: pserver 70.00%, keras 60.00%, difference +10.00 points" in r.stdout, r.stdout
