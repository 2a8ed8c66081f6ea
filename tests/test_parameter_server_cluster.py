"""ParameterServerStrategy and a TF_CONFIG cluster on other hosts: refused, never a silent
run of every task as a thread of this process."""

import json
import threading

import pytest

import jstrategy
from jstrategy._src.cluster.layout import is_this_machine
from jstrategy._src.cluster.layout import tasks_on_other_hosts
from jstrategy._src.cluster.spec import ClusterSpec

# TEST-NET-3 (RFC 5737): addresses that are never this machine; nothing is sent to them.
OTHER = ["203.0.113.10", "203.0.113.11"]


def _tf_config(monkeypatch, task_type="chief", worker_host=OTHER[0], ps_host=OTHER[1]):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {
                    "chief": ["localhost:2222"],
                    "worker": [f"{worker_host}:2223", f"{worker_host}:2224"],
                    "ps": [f"{ps_host}:2225"],
                },
                "task": {"type": task_type, "index": 0},
            }
        ),
    )


def test_a_cluster_on_other_hosts_is_refused_before_any_work(monkeypatch):
    _tf_config(monkeypatch)
    threads = threading.active_count()
    with pytest.raises(
        ValueError,
        match=r"backend='local'\) runs every worker and ps task as a thread of this process.*"
        r"203\.0\.113\.10 \(worker:0, worker:1\); 203\.0\.113\.11 \(ps:0\).*backend='ray'.*"
        r"local_cluster_resolver\(num_workers=2, num_ps=1\)",
    ):
        jstrategy.ParameterServerStrategy()
    assert threading.active_count() == threads  # no task was started


def test_one_remote_host_is_enough_to_refuse(monkeypatch):
    _tf_config(monkeypatch, worker_host="localhost")
    with pytest.raises(ValueError, match=r"other hosts: 203\.0\.113\.11 \(ps:0\)\."):
        jstrategy.ParameterServerStrategy()


def test_a_cluster_on_this_machine_still_runs_locally(monkeypatch):
    _tf_config(monkeypatch, worker_host="127.0.0.1", ps_host="localhost")
    strategy = jstrategy.ParameterServerStrategy()
    assert (strategy.num_workers, strategy.num_ps) == (2, 1)


def test_a_worker_task_is_told_what_runs_there_instead(monkeypatch):
    _tf_config(monkeypatch, task_type="worker")
    with pytest.raises(
        ValueError,
        match=r"this process is task 'worker':0\. In TF, worker and ps tasks .* "
        r"tf\.distribute\.Server\(\.\.\.\)\.join\(\).*ray start --address=",
    ):
        jstrategy.ParameterServerStrategy()


def test_hosts_of_this_machine():
    assert is_this_machine("localhost") and is_this_machine("127.0.0.2")
    assert is_this_machine("::1")
    assert not is_this_machine(OTHER[0])
    spec = ClusterSpec({"worker": [f"{OTHER[0]}:1", "localhost:2"], "ps": [f"{OTHER[0]}:3"]})
    assert tasks_on_other_hosts(spec, ["worker", "ps", "evaluator"]) == {
        OTHER[0]: ["worker:0", "ps:0"]
    }
