"""Multi-worker start-up: bounded, clear when it fails, and listening only where TF_CONFIG says.

The handshake itself is tested with threads in this process (fast, every failure mode);
the real start-up with real processes on 127.0.0.1, as the rest of the multi-worker suite.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jstrategy._src.cluster import rendezvous
from jstrategy._src.cluster.rendezvous import ClusterStartupError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_processes import WorkerProcess

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "startup_worker.py"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tasks(count: int, host: str = "127.0.0.1") -> list[tuple[str, int, str]]:
    return [("worker", i, f"{host}:{_free_port(host)}") for i in range(count)]


def _meet_in_threads(tasks, process_ids, timeout=5.0, bind=None):
    """Runs `meet` for each process id in a thread; returns {pid: None or the error}."""
    results: dict[int, BaseException | None] = {}

    def one(pid: int) -> None:
        try:
            rendezvous.meet(tasks, pid, bind_address=bind or tasks[0][2], timeout=timeout)
            results[pid] = None
        except BaseException as e:  # handed to the test
            results[pid] = e

    threads = [threading.Thread(target=one, args=(pid,)) for pid in process_ids]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # joiners retry until the coordinator listens, in any order
    for thread in threads:
        thread.join(timeout=timeout + 15)
        assert not thread.is_alive(), "meet did not return"
    return results


# The handshake -------------------------------------------------------------------------------
def test_all_processes_meet_and_the_port_is_free_again():
    tasks = _tasks(3)
    results = _meet_in_threads(tasks, [2, 1, 0])
    assert results == {0: None, 1: None, 2: None}
    host, port = rendezvous.split_address(tasks[0][2])
    with socket.create_server((host, port)):  # JAX's coordination service binds it next
        pass


def test_strangers_on_the_port_change_nothing():
    tasks = _tasks(2)
    host, port = rendezvous.split_address(tasks[0][2])
    idle: list[socket.socket] = []

    def strangers() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                junk = socket.create_connection((host, port), timeout=1)
            except OSError:
                time.sleep(0.01)
                continue
            junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
            junk.close()
            idle.append(socket.create_connection((host, port), timeout=1))  # says nothing
            return

    thread = threading.Thread(target=strangers)
    coordinator = threading.Thread(
        target=rendezvous.meet, args=(tasks, 0), kwargs={"bind_address": tasks[0][2], "timeout": 5}
    )
    coordinator.start()
    thread.start()
    thread.join()
    assert idle, "the strangers never connected"
    assert _meet_in_threads(tasks, [1]) == {1: None}
    coordinator.join(timeout=10)
    assert not coordinator.is_alive()
    idle[0].close()


def test_two_processes_claiming_one_task_fail_fast_on_every_side():
    tasks = _tasks(3)
    start = time.monotonic()
    results = _meet_in_threads(tasks, [0, 1, 1], timeout=20)
    assert time.monotonic() - start < 10
    errors = [e for e in results.values() if e is not None]
    assert errors and all(isinstance(e, ClusterStartupError) for e in errors)
    assert "two processes say they are worker 1" in str(results[0])
    assert "Give each process its own task index" in str(results[0])


def test_processes_that_disagree_on_the_cluster_fail_fast():
    tasks = _tasks(3)
    errors: dict[int, BaseException] = {}

    def joiner() -> None:
        try:
            rendezvous.meet(tasks[:2], 1, bind_address=tasks[0][2], timeout=20)
        except ClusterStartupError as e:
            errors[1] = e

    thread = threading.Thread(target=joiner)
    thread.start()
    with pytest.raises(ClusterStartupError, match="says it is process 1 of 2, but the"):
        rendezvous.meet(tasks, 0, bind_address=tasks[0][2], timeout=20)
    thread.join(timeout=10)
    assert "the same TF_CONFIG cluster" in str(errors[1])


def test_a_missing_task_is_named_by_the_coordinator_and_its_peers():
    tasks = _tasks(3)
    start = time.monotonic()
    results = _meet_in_threads(tasks, [0, 1], timeout=2)
    assert time.monotonic() - start < 8
    for pid in (0, 1):
        message = str(results[pid])
        assert "has not heard from worker 2 (127.0.0.1:" in message, message
        assert "timeout_seconds" in message


def test_an_unreachable_coordinator_is_named():
    tasks = _tasks(2)
    with pytest.raises(
        ClusterStartupError,
        match=r"worker 1 .* could not reach the coordinator, worker 0 \(127\.0\.0\.1:\d+\), "
        r"within 1 s \(ConnectionRefusedError",
    ):
        rendezvous.meet(tasks, 1, bind_address=tasks[0][2], timeout=1)


def test_another_program_answering_on_the_port_is_named():
    tasks = _tasks(2)
    host, port = rendezvous.split_address(tasks[0][2])
    with socket.create_server((host, port)) as server:

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(ClusterStartupError, match="another program answered"):
            rendezvous.meet(tasks, 1, bind_address=tasks[0][2], timeout=5)
        thread.join()


def test_coordinator_errors_before_listening():
    tasks = _tasks(2)
    host, port = rendezvous.split_address(tasks[0][2])
    with (
        socket.create_server((host, port)),
        pytest.raises(ClusterStartupError, match="that port is in use by another program"),
    ):
        rendezvous.meet(tasks, 0, bind_address=tasks[0][2], timeout=5)
    elsewhere = [("worker", 0, "203.0.113.7:2222"), ("worker", 1, "203.0.113.8:2222")]
    with pytest.raises(ClusterStartupError, match="this machine has no address '203.0.113.7'"):
        rendezvous.meet(elsewhere, 0, bind_address=elsewhere[0][2], timeout=5)
    trap = [("worker", 0, "localhost:2222"), ("worker", 1, "203.0.113.8:2222")]
    with pytest.raises(ClusterStartupError, match="loopback address on this machine, which the"):
        rendezvous.meet(trap, 0, bind_address=trap[0][2], timeout=5)


# Real processes ------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_port_in_use_and_missing_peers_are_clear_errors_within_seconds():
    timeout = 5
    taken_ports = [_free_port(), _free_port()]
    taken = {"worker": [f"127.0.0.1:{p}" for p in taken_ports]}
    alone = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    lonely = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    args = ("--timeout", str(timeout))
    with socket.create_server(("127.0.0.1", taken_ports[0])):  # another program holds it
        cases = {
            "port taken, worker 0": WorkerProcess(WORKER, taken, 0, *args),
            "port taken, worker 1": WorkerProcess(WORKER, taken, 1, *args),
            "worker 1 never starts, worker 0": WorkerProcess(WORKER, alone, 0, *args),
            "worker 0 never starts, worker 1": WorkerProcess(WORKER, lonely, 1, *args),
        }
        results = {}
        for name, proc in cases.items():
            code, output = proc.finish(timeout=120)
            assert proc.started is not None and proc.ended is not None, output[-3000:]
            results[name] = (code, output, proc.ended - proc.started)
    expected = {
        "port taken, worker 0": f"must listen on 127.0.0.1:{taken_ports[0]}, but that port is "
        "in use by another program",
        "port taken, worker 1": f"connected to 127.0.0.1:{taken_ports[0]}, the coordinator's "
        "address, but no jstrategy coordinator answered within 5 s",
        "worker 1 never starts, worker 0": f"has not heard from worker 1 ({alone['worker'][1]})",
        "worker 0 never starts, worker 1": "could not reach the coordinator, worker 0 "
        f"({lonely['worker'][0]}), within 5 s",
    }
    for name, (code, output, seconds) in results.items():
        print(f"{name}: exit {code} {seconds:.1f} s after starting")
        assert code == 1, output[-3000:]
        assert "ClusterStartupError: MultiWorkerMirroredStrategy cannot start" in output
        assert expected[name] in output, output[-3000:]
        assert "READY" not in output
        # JAX's own start-up waited 300 s, then aborted.
        assert seconds < timeout + 20, f"{name}: {seconds:.0f} s"


def _listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    import psutil

    found = []
    for pid in pids:
        process = psutil.Process(pid)
        for proc in [process, *process.children(recursive=True)]:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((proc.pid, conn.laddr.ip, conn.laddr.port))
    return found


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_local_job_listens_on_loopback_only():
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "120", str(WORKER), "--hold", "60",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    launcher = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines: list[str] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            if sum("READY" in line for line in lines) == 2:
                break
        assert sum("READY" in line for line in lines) == 2, "".join(lines)[-3000:]
        listeners = _listeners([launcher.pid])
    finally:
        launcher.terminate()
        launcher.communicate(timeout=60)
    print("listeners:", listeners)
    # The coordination service and each worker's collectives (gloo).
    assert len(listeners) >= 3, listeners
    assert all(_is_loopback(ip) for _, ip, _ in listeners), listeners


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_cluster_listens_on_the_addresses_tf_config_names():
    # 127.0.0.2 is a loopback address that this machine's hostname does not resolve to.
    host = "127.0.0.2"
    cluster = {"worker": [f"{host}:{_free_port(host)}" for _ in range(2)]}
    procs = [WorkerProcess(WORKER, cluster, i, "--timeout", "30", "--hold", "60") for i in range(2)]
    try:
        for proc in procs:
            proc.wait_for("READY", timeout=120)
        listeners = _listeners([p.popen.pid for p in procs])
    finally:
        for proc in procs:
            proc.popen.kill()
            proc.finish(timeout=30)
    print("listeners:", listeners)
    coordinator_port = int(cluster["worker"][0].rsplit(":", 1)[1])
    ips = {ip.removeprefix("::ffff:") for _, ip, _ in listeners}
    assert ips == {host}, listeners
    assert coordinator_port in {port for _, _, port in listeners}
    assert {pid for pid, _, _ in listeners} == {p.popen.pid for p in procs}  # gloo in both
