"""`pserver slurm` under a real single-node Slurm: a private munged, slurmctld and slurmd
started here as root from a generated slurm.conf (Debian's slurm-wlm and munge packages;
.ci/run installs them), then real `srun` steps: one trains to the end, one is scancelled."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

from pserver.wire.security import TOKEN_ENV
from tests.support.processes import LOGREG, free_port, missing, read_json, wait_until

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "squeue", "sinfo")
TOKEN = "slurm-Token_0123456789"


def unavailable(why: str) -> None:
    missing("the Slurm test", why)


SLURM_CONF = """\
ClusterName=pserver-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=30
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running single-node cluster; yields the environment for srun, scancel and squeue."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        unavailable(f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        unavailable("slurmd must run as root here (SlurmdUser=root)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir()
    os.chmod(d, 0o755)                   # munged wants the socket's directory searchable by all
    os.chmod(d / "munge", 0o755)
    subprocess.run(["mungekey", "--create", f"--keyfile={d}/munge/munge.key"], check=True)
    os.chmod(d / "munge" / "munge.key", 0o600)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=d,
                                      ctld_port=free_port(), d_port=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for argv in (["munged", "-F", "-f", f"--key-file={d}/munge/munge.key",
                             f"--socket={d}/munge/munge.socket", f"--pid-file={d}/munge/munged.pid",
                             f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/munged.seed"],)]
    assert wait_until(lambda: (d / "munge" / "munge.socket").exists(), 10), (
        (d / "munge" / "munged.log").read_text())
    daemons += [subprocess.Popen([name, "-D"] + (["-c"] if name == "slurmctld" else []), env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                for name in ("slurmctld", "slurmd")]
    try:
        def idle() -> bool:
            return "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                            text=True).stdout
        assert wait_until(idle, 30), f"the node never became idle: {daemon_logs(d)}"
        yield env
    finally:
        for p in reversed(daemons):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def daemon_logs(d: pathlib.Path) -> str:
    return "\n".join(f"== {f.name}\n{f.read_text()[-2000:]}" for f in sorted(d.glob("*.log")))


def cluster_state(env: dict, job_out: pathlib.Path, port: str) -> str:
    """What a job that never ended leaves to read: the queue, each job's and the node's state, the
    job's output so far, pserver's processes on its ports, and the daemons' logs."""
    def run(*argv: str) -> str:
        r = subprocess.run(argv, env=env, capture_output=True, text=True)
        return f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}"
    out = job_out.read_text() if job_out.exists() else "(no job output)"
    return "\n".join([run("squeue", "-a"), run("scontrol", "show", "job"), run("sinfo", "-R"),
                      run("scontrol", "show", "node"), f"== job output\n{out}",
                      run("pgrep", "-af", f"--base-port {port}"),
                      daemon_logs(pathlib.Path(env["SLURM_CONF"]).parent)])


def srun(env: dict, ntasks: int, *args: str, **popen) -> subprocess.Popen:
    """A real step: every task runs this checkout's pserver with the test's interpreter."""
    env = dict(env, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
               **{TOKEN_ENV: TOKEN})
    return subprocess.Popen(["srun", "--overcommit", f"--ntasks={ntasks}", "--kill-on-bad-exit=1",
                             "--chdir", str(ROOT), sys.executable, "-m", "pserver", "slurm", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_srun_trains_with_one_shard_and_two_workers_and_the_step_ends(slurm, tmp_path):
    summary, metrics = tmp_path / "summary.json", free_port()
    step = srun(slurm, 3, "--ps", "1", "--base-port", str(free_port()), *LOGREG, "--optimizer", "sgd",
                "--lr", "0.1", "--summary-json", str(summary), "--metrics-port", str(metrics))
    out, _ = step.communicate(timeout=300)
    assert step.returncode == 0, out
    # task i of the host serves its metrics on P + i: the shard first, then worker ranks 0, 1
    said = dict(re.findall(r"(shard 0|worker \d): Prometheus metrics at http://\S+?:(\d+)/metrics", out))
    assert said == {"shard 0": str(metrics), "worker 0": str(metrics + 1), "worker 1": str(metrics + 2)}, out
    roles = sorted(re.findall(r"task (\d) of 3 on \S+: (shard 0|worker rank \d)", out))
    assert roles == [("0", "shard 0"), ("1", "worker rank 0"), ("2", "worker rank 1")], out
    s = read_json(summary)
    assert s["num_workers"] == 2 and s["test_accuracy"] >= 0.9 and s["pushes_rejected"] == 0, s
    assert "shard 0 done (the chief ended the run)" in out, out
    assert TOKEN not in out


def test_scancel_stops_every_task_with_sigterm_and_the_shard_keeps_its_checkpoint(slurm, tmp_path):
    ckpt = tmp_path / "ckpt"
    long_run = [a if a != "2" else "500" for a in LOGREG]           # --epochs 500: still training
    port = str(free_port())
    step = srun(slurm, 3, "--ps", "1", "--base-port", port, *long_run, "--checkpoint-dir", str(ckpt))
    lines: list[str] = []
    for line in step.stdout:
        lines.append(line)
        if line.startswith("epoch 2/500"):          # training, well past the start
            break
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm, capture_output=True,
                          text=True).stdout.split()
    # no job: the step ended before its second epoch (once in a clean-clone CI run at load 8,
    # 62 s in, not reproduced in 6 runs since): say how, from its output and exit code
    assert len(jobs) == 1, (jobs, step.poll(), "".join(lines)[-3000:])
    subprocess.run(["scancel", jobs[0]], env=slurm, check=True)
    rest, _ = step.communicate(timeout=60)
    out = "".join(lines) + rest
    assert out.count("pserver slurm: stopped by SIGTERM") == 2, out          # both workers
    last = re.search(r"shard 0 stopped by SIGTERM at version (\d+)", out)
    assert last, out
    # the final state kept: a base, or a delta when an epoch's end wrote the base before the cancel
    # came (`...-v<final>.d<parent>.ckpt`; which one is a race of the cancel with that checkpoint)
    final = f"shard0-of1-v{int(last.group(1)):012d}"
    assert [p.name for p in ckpt.glob(f"{final}.ckpt")] + [p.name for p in ckpt.glob(f"{final}.d*.ckpt")], \
        (sorted(p.name for p in ckpt.iterdir()), out)
    # every task exited 128+SIGTERM within KillWait (no SIGKILL: that would be 137)
    assert step.returncode == 143 and "Killed" not in out, (step.returncode, out)
    assert wait_until(lambda: not subprocess.run(["squeue", "-h"], env=slurm, capture_output=True,
                                                 text=True).stdout.strip(), 30)
    # no task outlived the step (none detached from its process tree)
    assert subprocess.run(["pgrep", "-f", "--", f"--base-port {port}"]).returncode == 1


def test_the_sbatch_example_runs_as_written(slurm, tmp_path):
    """deploy/slurm/pserver.sbatch, submitted with sbatch --wait: its token file, its step."""
    env = dict(slurm, PYTHONPATH=str(ROOT),
               PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
               SHARDS="1", OPENBLAS_NUM_THREADS="1")
    env.pop(TOKEN_ENV, None)
    port = str(free_port())
    job = subprocess.Popen(["sbatch", "--wait", "--nodes=1", "--ntasks=3", "--overcommit",
                            f"--output={tmp_path}/job.out", str(ROOT / "deploy" / "slurm" / "pserver.sbatch"),
                            *LOGREG, "--optimizer", "sgd", "--lr", "0.1", "--base-port", port],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:        # say why: the job's state, the node's, its output, the daemons'
        job.kill()
        job.communicate()
        why = cluster_state(slurm, tmp_path / "job.out", port)
        subprocess.run(["scancel", "--full", "--name=pserver"], env=slurm)
        pytest.fail(f"sbatch --wait still waiting after 240 s:\n{why}")
    out = (tmp_path / "job.out").read_text()
    assert job.returncode == 0, stderr + out
    jobdir = next(tmp_path.glob("pserver-*"))
    assert (jobdir / "token").stat().st_mode & 0o777 == 0o600
    assert read_json(jobdir / "summary.json")["test_accuracy"] >= 0.9, out
    assert list((jobdir / "ckpt").glob("shard0-of1-v*.ckpt")), out
    assert (jobdir / "token").read_text().strip() not in out
