"""`pserver slurm`: every task of one `srun` step finds its role in Slurm's environment, as
TensorFlow's SlurmClusterResolver does.

    srun --ntasks=S+N pserver slurm --ps S [training flags]

Tasks 0..S-1 are the shards, the others workers with rank SLURM_PROCID - S (rank 0, the
chief, ends the shards when the run is over, so that the step ends). Slurm places tasks in
blocks by default: the first SLURM_STEP_TASKS_PER_NODE[0] on the first host of
SLURM_STEP_NODELIST, and so on; a task listens on --base-port plus its index on its host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pserver.errors import ConfigError

RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
GROUP = re.compile(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$")        # prefix[ranges]rest
REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")               # 2 or 2(x3)


@dataclass(frozen=True)
class SlurmTask:
    procid: int                      # SLURM_PROCID
    num_shards: int                  # S
    hosts: tuple[str, ...]           # the host of every task of the step, by task id
    ports: tuple[int, ...]           # the port of every task, by task id

    @property
    def is_shard(self) -> bool:
        return self.procid < self.num_shards

    @property
    def num_workers(self) -> int:
        return len(self.hosts) - self.num_shards

    @property
    def index(self) -> int:
        """The shard index, or the worker rank."""
        return self.procid if self.is_shard else self.procid - self.num_shards

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(f"{h}:{p}" for h, p in zip(self.hosts[:self.num_shards], self.ports))

    def describe(self) -> str:
        role = f"shard {self.index}" if self.is_shard else f"worker rank {self.index}"
        return (f"task {self.procid} of {len(self.hosts)} on {self.hosts[self.procid]}: {role} "
                f"({self.num_shards} shard(s), {self.num_workers} worker(s)); "
                f"shards at {','.join(self.shards)}")


def split_top(text: str) -> list[str]:
    """Split at the commas outside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if depth not in (0, 1):
            raise ValueError("brackets do not match")
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("brackets do not match")
    return parts + [text[start:]]


def expand_ranges(ranges: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: zero-padded to the width of each range's start."""
    out = []
    for part in ranges.split(","):
        m = RANGE.match(part.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"'{part}' is not a number or a range A-B with A <= B")
        first, last = m.group(1), m.group(2) or m.group(1)
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def expand_name(name: str) -> list[str]:
    """Every bracket group of one host pattern: 'r[1-2]n[1-2]' -> r1n1, r1n2, r2n1, r2n2."""
    m = GROUP.match(name)
    if m is None:
        if "[" in name or "]" in name:
            raise ValueError(f"'{name}' is not a host name or pattern")
        return [name]
    prefix, ranges, rest = m.groups()
    return [prefix + n + tail for n in expand_ranges(ranges) for tail in expand_name(rest)]


def expand_host(part: str) -> list[str]:
    if not part:
        raise ValueError("an empty host name")
    return expand_name(part)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, 'node[01-03,7],gpu1' -> node01, node02, node03, node7,
    gpu1 (TensorFlow's SlurmClusterResolver.expand_hostlist, with any number of bracket
    groups per name)."""
    try:
        return [h for part in split_top(text.strip()) for h in expand_host(part.strip())]
    except ValueError as e:
        raise ConfigError(f"SLURM_STEP_NODELIST: cannot read '{text}': {e}") from None


def expand_tasks_per_node(text: str) -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE)."""
    out = []
    for part in text.split(","):
        m = REPEAT.match(part.strip())
        if m is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: cannot read '{text}' ('{part}' is not N or N(xK))")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def environment_int(env, name: str) -> int:
    value = env.get(name)
    if value is None:
        raise ConfigError(f"{name}: not set; run `pserver slurm` as a task of `srun` "
                          f"(srun --ntasks=S+N pserver slurm --ps S ...)")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}: '{value}' is not an integer") from None


def slurm_task(env, num_shards: int, base_port: int) -> SlurmTask:
    """This task's place in the step, from Slurm's environment (os.environ, or a dict)."""
    procid, ntasks = environment_int(env, "SLURM_PROCID"), environment_int(env, "SLURM_STEP_NUM_TASKS")
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST", ""))
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    if len(per_node) != len(nodes) or sum(per_node) != ntasks:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE: {per_node} does not place {ntasks} tasks "
                          f"(SLURM_STEP_NUM_TASKS) on the {len(nodes)} host(s) of SLURM_STEP_NODELIST")
    if not 1 <= num_shards < ntasks:
        raise ConfigError(f"--ps: {num_shards} shard(s) leave no worker among the {ntasks} tasks "
                          f"of this step (srun --ntasks=S+N with N >= 1)")
    if not 1 <= base_port <= 65535 - max(per_node) + 1:
        raise ConfigError(f"--base-port: {base_port} + up to {max(per_node) - 1} is not a range of TCP ports")
    hosts = tuple(h for h, n in zip(nodes, per_node) for _ in range(n))
    ports = tuple(base_port + i for n in per_node for i in range(n))
    task = SlurmTask(procid, num_shards, hosts, ports)
    check_block_placement(env, task)
    return task


def check_block_placement(env, task: SlurmTask) -> None:
    """The ports of the other tasks are computed, not exchanged: that holds only when Slurm
    placed tasks in blocks (its default). A cyclic step would listen on other ports."""
    local = env.get("SLURM_LOCALID")
    first_here = task.hosts.index(task.hosts[task.procid])
    expected = task.procid - first_here
    node = env.get("SLURMD_NODENAME")
    if ((local is not None and local != str(expected))
            or (node is not None and node != task.hosts[task.procid])):
        raise ConfigError(f"SLURM_LOCALID: task {task.procid} is task {local} on {node or 'its host'}, where "
                          f"block placement puts it at {expected} on {task.hosts[task.procid]}; run srun "
                          "with --distribution=block (the default)")
