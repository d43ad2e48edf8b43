"""deploy/k8s: the TFJob manifest against the TFJob CRD's own OpenAPI schema, and the roles
pserver takes from TF_CONFIG exactly as the Kubeflow operator writes it for that manifest.

Both come from kubeflow/training-operator, branch release-1.9 at commit
078ec30ff26649a07d2e28893c332d4cef70e233 (the last line with the TFJob operator):
- tests/data/kubeflow/kubeflow.org_tfjobs.yaml.gz is manifests/base/crds/kubeflow.org_tfjobs.yaml
  of that commit, gzipped (Apache License 2.0).
- is_retryable_exit_code() below is IsRetryableExitCode in pkg/util/train/train_util.go, what
  the ExitCode restart policy (pkg/controller.v1/common/pod.go) asks of a failed pod.
- operator_tf_config() below follows, line for line, genTFConfigJSONStr and genClusterSpec in
  pkg/controller.v1/tensorflow/tensorflow.go, GetPortFromTFJob in
  pkg/controller.v1/tensorflow/util.go, GenGeneralName in pkg/controller.v1/common/util.go
  and the TFJobDefault* constants in pkg/apis/kubeflow.org/v1/tensorflow_types.go.
"""

from __future__ import annotations

import copy
import gzip
import json
import pathlib
import signal

import jsonschema
import pytest
import yaml

from pserver import cli
from pserver.errors import (
    AlreadyExists,
    ConfigError,
    DataError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ProcessFailed,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from pserver.signals import Stopped

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRD = ROOT / "tests" / "data" / "kubeflow" / "kubeflow.org_tfjobs.yaml.gz"
TFJOB = ROOT / "deploy" / "k8s" / "tfjob.yaml"
# pkg/apis/kubeflow.org/v1/tensorflow_types.go
TF_JOB_DEFAULT_PORT_NAME, TF_JOB_DEFAULT_CONTAINER_NAME, TF_JOB_DEFAULT_PORT = (
    "tfjob-port", "tensorflow", 2222)


def gen_general_name(job_name: str, rtype: str, index: str) -> str:
    """common.GenGeneralName."""
    return (job_name + "-" + rtype.lower() + "-" + index).replace("/", "-")


def get_port_from_tfjob(job: dict, rtype: str) -> int:
    """GetPortFromTFJob: the container named tensorflow, its port named tfjob-port, else 2222."""
    for container in job["spec"]["tfReplicaSpecs"][rtype]["template"]["spec"]["containers"]:
        if container["name"] == TF_JOB_DEFAULT_CONTAINER_NAME:
            for port in container.get("ports", []):
                if port.get("name") == TF_JOB_DEFAULT_PORT_NAME:
                    return port["containerPort"]
    return TF_JOB_DEFAULT_PORT


def gen_cluster_spec(job: dict, cluster_domain: str = "") -> dict:
    """genClusterSpec (CUSTOM_CLUSTER_DOMAIN unset unless given)."""
    cluster = {}
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        rt = rtype.lower()
        port = get_port_from_tfjob(job, rtype)
        names = []
        for i in range(spec["replicas"]):
            svc = (gen_general_name(job["metadata"]["name"], rt, str(i)) + "." + job["metadata"]["namespace"]
                   + ".svc")
            if cluster_domain:
                svc += "." + cluster_domain
            names.append(f"{svc}:{port}")
        cluster[rt] = names
    return cluster


def operator_tf_config(job: dict, rtype: str, index: int) -> str:
    """genTFConfigJSONStr without EnableDynamicWorker (the manifest does not set it)."""
    assert not job["spec"].get("enableDynamicWorker")
    return json.dumps({"cluster": gen_cluster_spec(job), "task": {"type": rtype.lower(), "index": index},
                       "environment": "cloud"})


@pytest.fixture(scope="module")
def tfjob() -> dict:
    return yaml.safe_load(TFJOB.read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def test_the_tfjob_manifest_is_valid_against_the_crd_schema(tfjob, schema):
    jsonschema.validate(tfjob, schema)
    assert tfjob["apiVersion"] == "kubeflow.org/v1" and tfjob["kind"] == "TFJob"


@pytest.mark.parametrize("path, value", [
    (("spec", "tfReplicaSpecs", "PS", "replicas"), "two"),
    (("spec", "tfReplicaSpecs", "Worker", "template", "spec", "containers"), [{"image": "no-name"}]),
    (("spec", "runPolicy", "backoffLimit"), "3"),
])
def test_the_schema_is_strict_enough_to_catch_a_broken_manifest(tfjob, schema, path, value):
    broken = copy.deepcopy(tfjob)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_every_replica_takes_its_role_from_the_operators_tf_config(tfjob, monkeypatch):
    specs = tfjob["spec"]["tfReplicaSpecs"]
    num_ps, num_workers = specs["PS"]["replicas"], specs["Worker"]["replicas"]
    ps = tuple(f"pserver-mnist-ps-{j}.default.svc:2222" for j in range(num_ps))
    parser = cli.build_parser()
    for j in range(num_ps):
        monkeypatch.setenv("TF_CONFIG", operator_tf_config(tfjob, "PS", j))
        args = specs["PS"]["template"]["spec"]["containers"][0]["args"]
        cfg = cli.server_config(parser.parse_args(args))
        assert (cfg.shard, cfg.num_shards, cfg.port, cfg.num_workers, cfg.host) == (j, num_ps, 2222,
                                                                                     num_workers, "0.0.0.0")
    for i in range(num_workers):
        monkeypatch.setenv("TF_CONFIG", operator_tf_config(tfjob, "Worker", i))
        args = specs["Worker"]["template"]["spec"]["containers"][0]["args"]
        cfg = cli.worker_config(parser.parse_args(args))
        assert (cfg.rank, cfg.num_workers, cfg.ps) == (i, num_workers, ps)     # worker 0 is the chief


def test_the_manifests_probe_the_shards_with_grpc_health_and_take_the_token_from_a_secret(tfjob):
    docs = [tfjob, *yaml.safe_load_all((ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text())]
    shards = [tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0],
              docs[2]["spec"]["template"]["spec"]["containers"][0]]
    for c in shards:
        assert c["readinessProbe"]["grpc"] == {"port": 2222, "service": "pserver.v1.ParameterServer"}
        assert c["livenessProbe"]["grpc"]["port"] == 2222
    every = shards + [tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0],
                      *(d["spec"]["template"]["spec"]["containers"][0] for d in docs[3:])]
    for c in every:
        (env,) = [e for e in c["env"] if e["name"] == "PSERVER_AUTH_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "pserver-token", "key": "token"}
    service, stateful, *workers = docs[1:]
    names = ",".join(f"{stateful['metadata']['name']}-{j}.{service['metadata']['name']}.default.svc:2222"
                     for j in range(stateful["spec"]["replicas"]))
    for w in workers:                  # the Job and the elastic workers' StatefulSet
        assert f"--ps {names}" in " ".join(w["spec"]["template"]["spec"]["containers"][0]["args"][0].split())


def is_retryable_exit_code(exit_code: int) -> bool:
    """train.IsRetryableExitCode: the ExitCode policy restarts a pod that failed with such a code."""
    return exit_code >= 128


def test_the_exit_code_policy_retries_what_a_restart_may_fix_and_nothing_else(tfjob):
    """Catches a transient failure (a shard unreachable past the deadline, a signal) that fails
    the job for good, and a user's mistake or a refused request that is retried forever."""
    for err in (ConfigError("x"), DataError("x"), InvalidArgument("x"), FailedPrecondition("x"),
                Unauthenticated("x"), AlreadyExists("x"), ProcessFailed("worker1", 2)):
        assert 1 <= err.exit_code <= 127 and not is_retryable_exit_code(err.exit_code), err
    for err in (Unavailable("x"), DeadlineExceeded("x"), ResourceExhausted("x"), ProcessFailed("ps0", -9),
                ProcessFailed("worker0", 143), Stopped(signal.SIGTERM), Stopped(signal.SIGINT)):
        assert is_retryable_exit_code(err.exit_code), err
    # launch's children: a code as the shell shows it (Popen's -9 for SIGKILL is 137); 128 is the first
    # transient one
    assert str(ProcessFailed("ps0", -9)) == "ps0 exited with code 137; stopping the cluster"
    assert [ProcessFailed("w", c).exit_code for c in (127, 128)] == [1, 138]
    assert ProcessFailed("ps1", 2).exit_code == 2       # a child's usage error stays one for the launcher
    for spec in tfjob["spec"]["tfReplicaSpecs"].values():
        assert spec["restartPolicy"] == "ExitCode"
    jobs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text())
            if d["kind"] == "Job"]
    (rule,) = jobs[0]["spec"]["podFailurePolicy"]["rules"]      # the plain Job: the same split
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [1, 2]


def test_the_elastic_workers_join_with_rank_auto_within_the_shards_max_workers():
    """Fails for elastic worker pods with a fixed rank (two pods would claim one), or shards
    without room for them (--max-workers): scaling the StatefulSet would add nobody."""
    import shlex

    from pserver.cli import build_parser, server_config, worker_config
    from pserver.config import AUTO_RANK
    docs = {d["metadata"]["name"]: d
            for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "statefulset.yaml").read_text())}

    def args(name, **env):
        text = docs[name]["spec"]["template"]["spec"]["containers"][0]["args"][0]
        for k, v in env.items():
            text = text.replace(k, v)
        return build_parser().parse_args(shlex.split(text.removeprefix("exec pserver ")))

    shard = server_config(args("pserver-ps", **{"${HOSTNAME##*-}": "0"}))
    worker = worker_config(args("pserver-workers-elastic"))
    assert docs["pserver-workers-elastic"]["spec"]["replicas"] == 0
    assert worker.rank == AUTO_RANK and shard.max_workers == worker.num_workers > shard.num_workers
