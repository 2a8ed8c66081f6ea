"""Cluster resolvers: ClusterSpec, TF_CONFIG validation, SLURM parsing, process layout."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from jstrategy._src.cluster.slurm import expand_hostlist
from jstrategy._src.cluster.slurm import expand_tasks_per_node
from jstrategy.cluster_resolver import ClusterResolver
from jstrategy.cluster_resolver import ClusterSpec
from jstrategy.cluster_resolver import ProcessLayout
from jstrategy.cluster_resolver import SimpleClusterResolver
from jstrategy.cluster_resolver import SlurmClusterResolver
from jstrategy.cluster_resolver import TFConfigClusterResolver
from jstrategy.cluster_resolver import training_process_layout

FULL_CLUSTER = {
    "chief": ["chief0:2222"],
    "worker": ["worker0:2222", "worker1:2222"],
    "ps": ["ps0:2222", "ps1:2222"],
    "evaluator": ["eval0:2222"],
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No TF_CONFIG or SLURM variable from the calling shell leaks into a test."""
    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def set_tf_config(monkeypatch, config):
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


# --- ClusterSpec -----------------------------------------------------------------------------


def test_cluster_spec_dense_and_sparse():
    spec = ClusterSpec({"worker": ["w0:1", "w1:1", "w2:1"], "ps": {3: "p3:1", 1: "p1:1"}})
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("ps") == 2
    assert spec.task_indices("ps") == [1, 3]
    assert spec.task_address("worker", 2) == "w2:1"
    assert spec.task_address("ps", 3) == "p3:1"
    assert spec.job_tasks("ps") == [None, "p1:1", None, "p3:1"]
    assert spec.job_tasks("worker") == ["w0:1", "w1:1", "w2:1"]
    assert spec.as_dict() == {"ps": {1: "p1:1", 3: "p3:1"}, "worker": ["w0:1", "w1:1", "w2:1"]}


def test_cluster_spec_equality_copy_and_repr():
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": {1: "p1:1"}})
    assert spec == ClusterSpec(spec)
    assert spec == {"worker": {0: "w0:1", 1: "w1:1"}, "ps": {1: "p1:1"}}
    assert spec != ClusterSpec({"worker": ["w0:1"]})
    assert spec != {"worker": "not a cluster"}
    assert eval(repr(spec)) == spec
    # JSON keys are strings; a sparse job read from TF_CONFIG must still work.
    assert ClusterSpec({"ps": {"1": "p1:1"}}) == ClusterSpec({"ps": {1: "p1:1"}})


@pytest.mark.parametrize("empty", [None, {}, ClusterSpec()])
def test_cluster_spec_empty(empty):
    spec = ClusterSpec(empty)
    assert not spec
    assert spec.jobs == []
    assert spec.as_dict() == {}
    assert bool(ClusterSpec({"worker": ["w:1"]}))


def test_cluster_spec_accepts_ipv6_and_hostnames():
    spec = ClusterSpec({"worker": ["[::1]:2222", "node-1.example.com:80", "10.0.0.1:65535"]})
    assert spec.task_address("worker", 0) == "[::1]:2222"


@pytest.mark.parametrize(
    ("cluster", "error", "match"),
    [
        (["w:1"], TypeError, r"`cluster` must be a dict .* got list"),
        ({"worker": "w:1"}, TypeError, r"job 'worker' must list its tasks .* got str"),
        ({"worker": [2222]}, TypeError, r"job 'worker' task 0 address must be a \"host:port\""),
        ({"worker": ["localhost"]}, ValueError, r"got 'localhost'\. Write it as \"host:port\""),
        ({"worker": ["grpc://w:1"]}, ValueError, r"without a protocol prefix"),
        ({"worker": ["w:0"]}, ValueError, r"port 0, which is not a usable port"),
        ({"worker": ["w:70000"]}, ValueError, r"port 70000"),
        ({"worker": []}, ValueError, r"job 'worker' has no tasks"),
        ({"1worker": ["w:1"]}, ValueError, r"job names must be identifiers .* got '1worker'"),
        ({"ps": {-1: "p:1"}}, ValueError, r"non-negative ints; got -1"),
        ({"ps": {True: "p:1"}}, ValueError, r"non-negative ints; got True"),
    ],
)
def test_cluster_spec_rejects(cluster, error, match):
    with pytest.raises(error, match=match):
        ClusterSpec(cluster)


def test_cluster_spec_lookup_errors():
    spec = ClusterSpec({"worker": ["w0:1", "w1:1"]})
    with pytest.raises(ValueError, match=r"No job 'ps' in the cluster; its jobs are \['worker'\]"):
        spec.task_address("ps", 0)
    with pytest.raises(ValueError, match=r"Job 'worker' has no task 2; .* are \[0, 1\]"):
        spec.task_address("worker", 2)
    with pytest.raises(ValueError, match="No job 'chief'"):
        spec.num_tasks("chief")


# --- TFConfigClusterResolver: errors ---------------------------------------------------------

WORKERS = {"worker": ["w0:2222", "w1:2222"]}


@pytest.mark.parametrize(
    ("tf_config", "match"),
    [
        ('{"cluster": ', r"TF_CONFIG is not valid JSON .*got '\{\"cluster\": '\. Set it to"),
        ("[1, 2]", r"TF_CONFIG must be a JSON object; got list"),
        ({"cluster": WORKERS}, r'has a "cluster" \(jobs "worker"\) but no "task".* Add "task"'),
        (
            {"task": {"type": "worker", "index": 0}},
            r'has a "task" \(\{"type": "worker", "index": 0\}\) but no "cluster"\. Add',
        ),
        ({"cluster": WORKERS, "task": "worker"}, r'"task" must be an object .*got "worker"'),
        (
            {"cluster": WORKERS, "task": {"type": "trainer", "index": 0}},
            r"task type 'trainer' is not a known task type; expected one of \"chief\", "
            r"\"evaluator\", \"master\", \"ps\", \"worker\"\. Fix \"task\"",
        ),
        (
            {"cluster": {**WORKERS, "trainer": ["t:1"]}, "task": {"type": "worker", "index": 0}},
            r'cluster has unknown job "trainer"',
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": 3}},
            re.escape(
                'TF_CONFIG task index 3 is out of range: the cluster has 2 "worker" tasks '
                '(indices 0-1). Fix "task": {"type": "worker", "index": ...}.'
            ),
        ),
        (
            {"cluster": {"chief": ["c:1"]}, "task": {"type": "chief", "index": 1}},
            r'index 1 is out of range: the cluster has 1 "chief" task \(index 0\)',
        ),
        (
            {
                "cluster": {"worker": {"0": "w0:1", "2": "w2:1"}},
                "task": {"type": "worker", "index": 1},
            },
            r'has 2 "worker" tasks \(indices 0, 2\)',
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": -1}},
            r"task index must be non-negative; got -1\. Fix",
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": "1"}},
            re.escape(
                "TF_CONFIG task index must be an int; got '1' (str). "
                'Fix "task": {"type": "worker", "index": 1}.'
            ),
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": True}},
            r"task index must be an int; got True \(bool\)",
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": 1.0}},
            r"task index must be an int; got 1\.0 \(float\)\. .*\"index\": 1\}",
        ),
        ({"cluster": WORKERS, "task": {"type": "worker"}}, r'task of type "worker" has no index'),
        ({"cluster": WORKERS, "task": {"index": 0}}, r"has a cluster .* but no task type"),
        (
            {"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}},
            r'uses address "h:1" for both "worker" task 0 and "worker" task 1; every task '
            r"needs its own",
        ),
        (
            {
                "cluster": {"chief": ["h:1"], "worker": ["h:1"]},
                "task": {"type": "chief", "index": 0},
            },
            r'address "h:1" for both "chief" task 0 and "worker" task 0',
        ),
        (
            {
                "cluster": {"chief": ["c:1", "c:2"], **WORKERS},
                "task": {"type": "worker", "index": 0},
            },
            r'2 chief tasks \("chief" task 0, "chief" task 1\); there can be at most one',
        ),
        (
            {
                "cluster": {"chief": ["c:1"], "master": ["m:1"]},
                "task": {"type": "chief", "index": 0},
            },
            r'2 chief tasks \("chief" task 0, "master" task 0\)',
        ),
        (
            {
                "cluster": {**WORKERS, "evaluator": ["e:1", "e:2"]},
                "task": {"type": "worker", "index": 0},
            },
            r'2 "evaluator" tasks .*there can be at most one',
        ),
        (
            {"cluster": WORKERS, "task": {"type": "evaluator", "index": 1}},
            r"task index 1 is invalid for the evaluator",
        ),
        (
            {"cluster": WORKERS, "task": {"type": "ps", "index": 0}},
            r'task type "ps" is not in the cluster, whose jobs are "worker"\. Add a "ps" job .*'
            r"or fix this process's task type",
        ),
        (
            {"cluster": {"ps": ["p:1"]}, "task": {"type": "ps", "index": 0}},
            r'no chief or worker task to train \(its jobs are "ps"\)',
        ),
        (
            {"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}},
            r'TF_CONFIG "cluster" is invalid: job \'worker\' task 0 address must be a "host:port"',
        ),
        (
            {"cluster": ["w:1"], "task": {"type": "worker", "index": 0}},
            r'TF_CONFIG "cluster" is invalid: `cluster` must be a dict',
        ),
        (
            {"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}},
            r"job 'worker' has no tasks",
        ),
        (
            {"cluster": WORKERS, "task": {"type": "worker", "index": 0}, "rpc_layer": 1},
            r'TF_CONFIG "rpc_layer" must be a string; got 1',
        ),
    ],
)
def test_tf_config_errors(monkeypatch, tf_config, match):
    set_tf_config(monkeypatch, tf_config)
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver()


def test_tf_config_override_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"task_type='worker', task_id=0 were given but TF_CONFIG"):
        TFConfigClusterResolver(task_type="worker", task_id=0)
    set_tf_config(monkeypatch, {"cluster": WORKERS, "task": {"type": "worker", "index": 0}})
    with pytest.raises(ValueError, match=r"task index 2 is out of range"):
        TFConfigClusterResolver(task_id=2)


# --- TFConfigClusterResolver: valid configurations -------------------------------------------


@pytest.mark.parametrize(
    ("task_type", "task_id"),
    [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 1), ("evaluator", 0)],
)
def test_tf_config_full_cluster(monkeypatch, task_type, task_id):
    set_tf_config(
        monkeypatch,
        {
            "cluster": FULL_CLUSTER,
            "task": {"type": task_type, "index": task_id},
            "rpc_layer": "grpc",
            "environment": "cloud",
        },
    )
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec(FULL_CLUSTER)
    assert (resolver.task_type, resolver.task_id) == (task_type, task_id)
    assert resolver.rpc_layer == "grpc"
    assert resolver.environment == "cloud"
    address = FULL_CLUSTER[task_type][task_id]
    assert resolver.master() == f"grpc://{address}"
    assert resolver.master("ps", 0, rpc_layer="http") == "http://ps0:2222"


def test_tf_config_evaluator_outside_cluster(monkeypatch):
    set_tf_config(monkeypatch, {"cluster": WORKERS, "task": {"type": "evaluator", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("evaluator", 0)
    assert resolver.cluster_spec() == ClusterSpec(WORKERS)


def test_tf_config_overrides(monkeypatch):
    set_tf_config(
        monkeypatch, {"cluster": WORKERS, "task": {"type": "worker", "index": 0}, "rpc_layer": "x"}
    )
    resolver = TFConfigClusterResolver(task_id=1, rpc_layer="grpc", environment="google")
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.master() == "grpc://w1:2222"
    assert resolver.environment == "google"


def test_tf_config_master_special_cases(monkeypatch):
    set_tf_config(
        monkeypatch, {"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}
    )
    assert TFConfigClusterResolver().master() == ""
    set_tf_config(
        monkeypatch,
        {"cluster": WORKERS, "task": {"type": "worker", "index": 1}, "session_master": "s:9"},
    )
    assert TFConfigClusterResolver().master() == "s:9"


def test_tf_config_is_read_at_construction(monkeypatch):
    set_tf_config(monkeypatch, {"cluster": WORKERS, "task": {"type": "worker", "index": 1}})
    resolver = TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", "not json")
    assert resolver.task_id == 1
    assert resolver.cluster_spec() == ClusterSpec(WORKERS)


@pytest.mark.parametrize("tf_config", [None, "", "   ", "{}"])
def test_tf_config_absent_is_a_single_local_process(monkeypatch, tf_config):
    if tf_config is not None:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    resolver = TFConfigClusterResolver()
    assert not resolver.cluster_spec()
    assert resolver.task_type is None
    assert resolver.task_id is None
    assert resolver.rpc_layer is None
    assert resolver.environment is None
    assert resolver.master() == ""


def test_num_accelerators_counts_local_jax_devices():
    assert {d.platform for d in jax.local_devices()} == {"cpu"}  # The test setup.
    assert TFConfigClusterResolver().num_accelerators() == {}
    given = SimpleClusterResolver(ClusterSpec(), num_accelerators={"GPU": 4})
    assert given.num_accelerators() == {"GPU": 4}
    assert SimpleClusterResolver(ClusterSpec()).num_accelerators() == {}


@pytest.mark.multiprocess
def test_constructors_do_not_start_jax(tmp_path):
    # In a fresh interpreter: building resolvers must leave JAX's backends uninitialized, so
    # jax.distributed.initialize can still run afterwards.
    code = """
import json, os
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})
os.environ.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n[1-2]",
                  SLURM_TASKS_PER_NODE="1(x2)")
from jax._src import xla_bridge
from jstrategy import cluster_resolver as cr
for resolver in (cr.TFConfigClusterResolver(), cr.SlurmClusterResolver(),
                 cr.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=0)):
    cr.training_process_layout(resolver)
print("initialized", xla_bridge.backends_are_initialized())
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "initialized False" in result.stdout


# --- SimpleClusterResolver -------------------------------------------------------------------


def test_simple_cluster_resolver():
    resolver = SimpleClusterResolver(
        ClusterSpec(WORKERS), master="m:1", task_type="worker", task_id=1, environment="google"
    )
    assert isinstance(resolver, ClusterResolver)
    assert resolver.cluster_spec() == ClusterSpec(WORKERS)
    assert resolver.master() == "m:1"
    assert resolver.master("worker", 0) == "w0:2222"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://w0:2222"
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 1, "google")
    assert SimpleClusterResolver(WORKERS, rpc_layer="grpc").master("worker", 1) == "grpc://w1:2222"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cluster_spec": ["w:1"]}, r"`cluster_spec` must be a ClusterSpec .*got list"),
        ({"cluster_spec": ClusterSpec(), "master": None}, r"`master` must be a string"),
        ({"cluster_spec": ClusterSpec(), "task_id": "0"}, r"`task_id` must be an int"),
        ({"cluster_spec": ClusterSpec(), "num_accelerators": 4}, r"`num_accelerators` must be"),
    ],
)
def test_simple_cluster_resolver_rejects(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SimpleClusterResolver(**kwargs)


# --- Process layout --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_type", "task_id", "process_id", "is_chief"),
    [
        ("chief", 0, 0, True),
        ("worker", 0, 1, False),
        ("worker", 1, 2, False),
        ("ps", 0, None, False),
        ("ps", 1, None, False),
        ("evaluator", 0, None, False),
    ],
)
def test_layout_with_chief(monkeypatch, task_type, task_id, process_id, is_chief):
    set_tf_config(
        monkeypatch, {"cluster": FULL_CLUSTER, "task": {"type": task_type, "index": task_id}}
    )
    layout = training_process_layout(TFConfigClusterResolver())
    assert layout == ProcessLayout(
        coordinator_address="chief0:2222",
        num_processes=3,
        process_id=process_id,
        is_chief=is_chief,
        task_type=task_type,
        task_id=task_id,
        tasks=(
            ("chief", 0, "chief0:2222"),
            ("worker", 0, "worker0:2222"),
            ("worker", 1, "worker1:2222"),
        ),
    )


@pytest.mark.parametrize("task_id", [0, 1, 2])
def test_layout_without_chief(task_id):
    cluster = {"worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1"]}
    layout = training_process_layout(
        SimpleClusterResolver(cluster, task_type="worker", task_id=task_id)
    )
    assert layout.coordinator_address == "w0:1"
    assert layout.num_processes == 3
    assert layout.process_id == task_id
    assert layout.is_chief == (task_id == 0)


def test_layout_master_is_the_chief():
    cluster = {"master": ["m:1"], "worker": ["w0:1"]}
    master = training_process_layout(SimpleClusterResolver(cluster, task_type="master", task_id=0))
    worker = training_process_layout(SimpleClusterResolver(cluster, task_type="worker", task_id=0))
    assert (master.coordinator_address, master.process_id, master.is_chief) == ("m:1", 0, True)
    assert (worker.num_processes, worker.process_id, worker.is_chief) == (2, 1, False)


def test_layout_single_local_process():
    layout = training_process_layout(TFConfigClusterResolver())
    assert layout == ProcessLayout(
        coordinator_address=None,
        num_processes=1,
        process_id=0,
        is_chief=True,
        task_type=None,
        task_id=None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.process_id = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cluster", "task_type", "task_id", "match"),
    [
        (
            {"trainer": ["t:1"]},
            "trainer",
            0,
            r'SimpleClusterResolver cluster has unknown job "trainer"',
        ),
        (
            WORKERS,
            "worker",
            5,
            r"SimpleClusterResolver task index 5 is out of range.*Fix task_type",
        ),
        (WORKERS, None, None, r"SimpleClusterResolver has a cluster .* but no task type"),
        ({"worker": {0: "w0:1", 2: "w2:1"}}, "worker", 0, r'lists the "worker" job sparsely'),
    ],
)
def test_layout_validates_any_resolver(cluster, task_type, task_id, match):
    resolver = SimpleClusterResolver(cluster, task_type=task_type, task_id=task_id)
    with pytest.raises(ValueError, match=match):
        training_process_layout(resolver)


def test_layout_rejects_non_resolvers():
    with pytest.raises(TypeError, match=r"`resolver` must be a ClusterResolver"):
        training_process_layout({"worker": ["w:1"]})  # type: ignore[arg-type]


# --- SLURM -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node1", ["node1"]),
        ("node[01-03,7],gpu-a[1-2]", ["node01", "node02", "node03", "node7", "gpu-a1", "gpu-a2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("b,a", ["b", "a"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu[3]-ib.cluster", ["gpu3-ib.cluster"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    "hostlist", ["node[1-", "node[3-1]", "node[a-b]", "", "a,,b", "n[1-2-3]", "a]b[1]", "n[[1]]"]
)
def test_expand_hostlist_rejects(hostlist):
    with pytest.raises(ValueError, match=re.escape(f"Invalid SLURM hostlist {hostlist!r}")):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2", [1, 2]), ("3(x2)", [3, 3])],
)
def test_expand_tasks_per_node(text, expected):
    assert expand_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["2(x)", "x", "", "2(x3)1", "-1"])
def test_expand_tasks_per_node_rejects(text):
    with pytest.raises(ValueError, match=re.escape(f"Invalid SLURM tasks-per-node list {text!r}")):
        expand_tasks_per_node(text)


def set_slurm(monkeypatch, procid, ntasks, nodelist, tasks_per_node, *, step=True):
    prefix = "SLURM_STEP_" if step else "SLURM_"
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS" if step else "SLURM_NTASKS", str(ntasks))
    monkeypatch.setenv("SLURM_STEP_NODELIST" if step else "SLURM_JOB_NODELIST", nodelist)
    monkeypatch.setenv(f"{prefix}TASKS_PER_NODE", tasks_per_node)


@pytest.mark.parametrize(
    ("rank", "task_type", "task_id", "address"),
    [
        (0, "chief", 0, "node01:8888"),
        (1, "ps", 0, "node01:8889"),
        (2, "worker", 0, "node02:8888"),
        (5, "worker", 3, "gpu1:8889"),
    ],
)
def test_slurm_resolver(monkeypatch, rank, task_type, task_id, address):
    set_slurm(monkeypatch, rank, 6, "node[01-02],gpu1", "2(x3)")
    # Given out of order: as in TF, ranks go to the jobs in sorted job-name order.
    resolver = SlurmClusterResolver(jobs={"worker": 4, "ps": 1, "chief": 1})
    assert resolver.cluster_spec() == ClusterSpec(
        {
            "chief": ["node01:8888"],
            "ps": ["node01:8889"],
            "worker": ["node02:8888", "node02:8889", "gpu1:8888", "gpu1:8889"],
        }
    )
    assert (resolver.task_type, resolver.task_id) == (task_type, task_id)
    assert resolver.get_task_info() == (task_type, task_id)
    assert resolver.master() == f"grpc://{address}"
    assert resolver.master("chief", 0, rpc_layer="http") == "http://node01:8888"
    assert resolver.environment == ""
    layout = training_process_layout(resolver)
    assert (layout.coordinator_address, layout.num_processes) == ("node01:8888", 5)
    assert layout.process_id == {"chief": 0, "ps": None, "worker": (task_id or 0) + 1}[task_type]


def test_slurm_resolver_job_level_variables_and_node_order(monkeypatch):
    # Job-level fallbacks; uneven tasks per node; SLURM's node order kept (n9 before n10).
    set_slurm(monkeypatch, 2, 3, "n[9-10]", "2,1", step=False)
    resolver = SlurmClusterResolver(port_base=7000)
    assert resolver.cluster_spec() == ClusterSpec({"worker": ["n9:7000", "n9:7001", "n10:7000"]})
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)


def test_slurm_resolver_step_variables_win(monkeypatch):
    set_slurm(monkeypatch, 0, 2, "step[1-2]", "1(x2)")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "job[1-4]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x4)")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert SlurmClusterResolver().cluster_spec() == ClusterSpec(
        {"worker": ["step1:8888", "step2:8888"]}
    )


def test_slurm_resolver_tasks_per_node_overrides(monkeypatch):
    set_slurm(monkeypatch, 1, 4, "a,b", "1(x2)")
    resolver = SlurmClusterResolver(tasks_per_node=2)
    assert resolver.cluster_spec() == ClusterSpec(
        {"worker": ["a:8888", "a:8889", "b:8888", "b:8889"]}
    )
    resolver = SlurmClusterResolver(tasks_per_node={"b": 3, "a": 1})
    assert resolver.cluster_spec() == ClusterSpec(
        {"worker": ["b:8888", "b:8889", "b:8890", "a:8888"]}
    )
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_slurm_resolver_gpus(monkeypatch):
    set_slurm(monkeypatch, 1, 4, "a,b", "2(x2)")
    # monkeypatch restores CUDA_VISIBLE_DEVICES, which auto_set_gpu rewrites.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    resolver = SlurmClusterResolver(auto_set_gpu=True)
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    set_slurm(monkeypatch, 2, 4, "a,b", "2(x2)")
    SlurmClusterResolver(gpus_per_node=8, gpus_per_task=3, auto_set_gpu=True)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    with pytest.raises(RuntimeError, match=r"Requested 3 GPUs per task for up to 2 tasks per node"):
        SlurmClusterResolver(gpus_per_node=4, gpus_per_task=3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"auto_set_gpu=True but there are no GPUs"):
        SlurmClusterResolver(auto_set_gpu=True)
    # Without known GPUs the count falls back to the local JAX accelerators (none here).
    assert SlurmClusterResolver().num_accelerators() == {}


def test_slurm_resolver_outside_slurm():
    with pytest.raises(RuntimeError, match=r"SLURM_PROCID is not set: this process is not running"):
        SlurmClusterResolver()


@pytest.mark.parametrize(
    ("slurm", "kwargs", "error", "match"),
    [
        ((0, 2, "a,b", "1(x2)"), {"jobs": {"worker": 3}}, ValueError, r"`jobs` asks for 3 tasks"),
        (
            (0, 3, "a,b", "1(x2)"),
            {},
            ValueError,
            r"The SLURM step has 3 tasks but the nodes hold 2",
        ),
        ((0, 2, "a,b", "2"), {}, ValueError, r"gives task counts for 1 nodes \[2\] but .* has 2"),
        ((2, 2, "a,b", "1(x2)"), {}, ValueError, r"SLURM_PROCID=2 is out of range"),
        ((0, 2, "a,a", "1(x2)"), {}, ValueError, r"names a host twice"),
        ((0, 2, "a,b", "1(x2)"), {"jobs": {"worker": "2"}}, TypeError, r"`jobs` must be a dict"),
        ((0, 2, "a,b", "1(x2)"), {"tasks_per_node": "1"}, TypeError, r"`tasks_per_node` must"),
        ((0, 2, "a,b", "1(x2)"), {"port_base": 0}, ValueError, r"`port_base` must leave room"),
        (("x", 2, "a,b", "1(x2)"), {}, ValueError, r"SLURM_PROCID must be a non-negative integer"),
    ],
)
def test_slurm_resolver_rejects(monkeypatch, slurm, kwargs, error, match):
    set_slurm(monkeypatch, *slurm)
    with pytest.raises(error, match=match):
        SlurmClusterResolver(**kwargs)
