"""`jstrategy.cluster_resolver.join`: the one way into a multi-process job, for every
strategy that spans processes; two real processes on 127.0.0.1 for the runtime it starts."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import time
from pathlib import Path

import jax
import pytest

import jstrategy
from jstrategy._src import jax_compat
from jstrategy.cluster_resolver import Cluster
from jstrategy.cluster_resolver import SimpleClusterResolver
from jstrategy.cluster_resolver import join
from jstrategy.coordinator import local_cluster_resolver

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_processes import ROOT
from worker_processes import WorkerProcess

SCRIPT = ROOT / "tests" / "cluster_worker.py"
REFUSED = "must come before any other JAX computation"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_workers() -> dict:
    return {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}


def test_one_process_starts_nothing_and_joins_once(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    cluster = join()
    assert cluster == Cluster(0, 1, None, None, True, None, (), connected=False)
    assert join() is cluster and cluster.num_workers == 1
    # Every strategy that can span processes holds the one cluster join returned.
    assert jstrategy.MultiWorkerMirroredStrategy()._cluster is cluster
    assert jstrategy.experimental.FSDPStrategy()._cluster is cluster
    assert jax_compat.distributed_client() is None


def test_an_evaluator_stays_out_and_starts_nothing(monkeypatch):
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    )
    joined = join(timeout_seconds=5)  # would wait for the workers if it met them
    assert (joined.process_id, joined.num_processes, joined.is_chief) == (None, 2, False)
    assert not joined.connected and joined.num_workers == 1
    assert join() is joined
    assert jax_compat.distributed_client() is None


def test_the_parameter_server_chief_describes_its_job_without_a_runtime():
    strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=2))
    cluster = join(local_cluster_resolver(num_workers=2), start_runtime=False)
    assert strategy._cluster is cluster
    assert (cluster.task_type, cluster.process_id, cluster.num_processes) == ("chief", 0, 3)
    assert cluster.is_chief and not cluster.connected
    assert jax_compat.distributed_client() is None


def test_every_door_refuses_to_start_after_jax_did_before_meeting(monkeypatch):
    jax.devices()  # the backends have started
    resolver = SimpleClusterResolver(_two_workers(), task_type="worker", task_id=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=REFUSED):
        join(resolver)
    with pytest.raises(RuntimeError, match=REFUSED):
        jstrategy.MultiWorkerMirroredStrategy(resolver)
    with pytest.raises(RuntimeError, match=REFUSED):
        jstrategy.experimental.FSDPStrategy(cluster_resolver=resolver)
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    with pytest.raises(RuntimeError, match=REFUSED):
        jstrategy.experimental.ModelParallelStrategy(
            jstrategy.experimental.LayoutMap(mesh), cluster_resolver=resolver
        )
    # A multi-host TPU slice goes through the same door (JAX finds the hosts itself there).
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t-0,t-1")
    tpu_resolver = jstrategy.cluster_resolver.TPUClusterResolver()
    with pytest.raises(RuntimeError, match=REFUSED):
        jstrategy.config.experimental_connect_to_cluster(tpu_resolver)
    with pytest.raises(RuntimeError, match=REFUSED):
        jstrategy.TPUStrategy(tpu_resolver)
    assert time.monotonic() - start < 5  # nobody waited for the other worker
    assert jax_compat.distributed_client() is None


def test_join_validates_its_arguments():
    with pytest.raises(ValueError, match=r"`timeout_seconds` must be a positive float; got 0\."):
        join(SimpleClusterResolver({}), timeout_seconds=0)
    with pytest.raises(ValueError, match=r"`start_runtime` must be a bool; got 'no'"):
        join(SimpleClusterResolver({}), start_runtime="no")
    with pytest.raises(
        TypeError, match=r"`cluster_resolver` must be a .*ClusterResolver.*got dict"
    ):
        join({"worker": ["127.0.0.1:1"]})
    with pytest.raises(ValueError, match="has a cluster .* but no task type"):
        join(SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}))


def test_only_the_cluster_module_starts_the_runtime():
    package = ROOT / "jstrategy"
    callers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "distributed.initialize(" in path.read_text(encoding="utf-8")
    )
    assert callers == ["_src/cluster/join.py"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_model_parallel_on_two_processes_joins_once_and_sigterm_stops_it():
    # JAX's preemption service takes SIGTERM at its start; join gives it back, so a
    # sharded strategy's worker stops on SIGTERM as a MultiWorkerMirrored one does.
    cluster = _two_workers()
    procs = [WorkerProcess(SCRIPT, cluster, i) for i in range(2)]
    try:
        for proc in procs:
            proc.wait_for("READY", timeout=150)
        procs[1].popen.send_signal(signal.SIGTERM)
        code = procs[1].popen.wait(timeout=30)
    finally:
        for proc in procs:
            proc.popen.kill()
        outputs = [proc.finish(timeout=30)[1] for proc in procs]
    for index, output in enumerate(outputs):
        joined = f"JOINED {index} of 2 chief={index == 0} connected=True workers=2 devices=4"
        assert joined in output, output[-3000:]
        assert "SAME True True True" in output, output[-3000:]
        said = re.search(r"CONTRADICTION (.*)", output)
        assert said, output[-3000:]
        assert (
            f"already running as process {index} of 2, but the cluster resolver says "
            f"process {1 - index} of 2"
        ) in said[1]
        assert "SUM 2" in output, output[-3000:]
    assert code == -signal.SIGTERM, outputs[1][-3000:]
