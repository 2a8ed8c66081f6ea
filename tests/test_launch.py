"""The local launcher, with real worker processes running tiny pure-Python scripts."""

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jstrategy._src.cluster import launch as launch_lib
from jstrategy._src.cluster.launch import TIMEOUT_EXIT_CODE
from jstrategy._src.cluster.launch import launch
from jstrategy._src.cluster.launch import main

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Every wait in these tests is bounded by this (or by the launcher's own timeout).
DEADLINE_S = 60.0

# Helpers every worker script starts with: its task, and a bounded wait for a file.
PRELUDE = """
import json, os, pathlib, signal, socket, sys, time
TF_CONFIG = json.loads(os.environ["TF_CONFIG"])
TASK = TF_CONFIG["task"]["type"] + "-" + str(TF_CONFIG["task"]["index"])
OUT = pathlib.Path(sys.argv[1])

def wait_for(path, limit=30.0):
    end = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > end:
            sys.exit(99)
        time.sleep(0.02)

def write_pid():
    # Atomically, so nobody reads a half-written file.
    (OUT / f"{TASK}.tmp").write_text(str(os.getpid()))
    os.replace(OUT / f"{TASK}.tmp", OUT / f"{TASK}.pid")
"""


def write_script(tmp_path, body):
    script = tmp_path / "worker.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out"
    out.mkdir()
    return str(script), out


def assert_gone(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def read_pids(out, names):
    return {name: int((out / f"{name}.pid").read_text()) for name in names}


@pytest.mark.multiprocess
def test_each_worker_gets_its_tf_config_and_prefixed_output(tmp_path, capsys):
    script, out = write_script(
        tmp_path,
        """
        # Bind this task's own address, as a server would: proves the port was free for it.
        host, port = TF_CONFIG["cluster"][TF_CONFIG["task"]["type"]][TF_CONFIG["task"]["index"]].rsplit(":", 1)
        with socket.socket() as sock:
            sock.bind((host, int(port)))
        record = {"tf_config": TF_CONFIG, "args": sys.argv[2:],
                  "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
                  "extra": os.environ.get("EXTRA_VAR")}
        (OUT / f"{TASK}.json").write_text(json.dumps(record))
        print(f"hello from {TASK}")
        print(f"warning from {TASK}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """,
    )
    code = launch(
        script,
        [str(out), "--flag", "value"],
        num_workers=2,
        chief=True,
        timeout=DEADLINE_S,
        env={"EXTRA_VAR": "yes"},
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err

    names = ["chief-0", "worker-0", "worker-1"]
    records = {name: json.loads((out / f"{name}.json").read_text()) for name in names}
    cluster = records["chief-0"]["tf_config"]["cluster"]
    assert sorted(cluster) == ["chief", "worker"]
    assert (len(cluster["chief"]), len(cluster["worker"])) == (1, 2)
    addresses = cluster["chief"] + cluster["worker"]
    assert all(address.startswith("127.0.0.1:") for address in addresses)
    assert len(set(addresses)) == 3
    for name, record in records.items():
        task_type, index = name.split("-")
        assert record["tf_config"] == {
            "cluster": cluster,
            "task": {"type": task_type, "index": int(index)},
        }
        assert record["args"] == ["--flag", "value"]
        assert record["unbuffered"] == "1"
        assert record["extra"] == "yes"

    for name in names:
        assert f"[{name}] hello from {name}\n" in captured.out
        assert f"[{name}] no newline at the end\n" in captured.out
        assert f"[{name}] warning from {name}\n" in captured.err
    assert all(line.startswith("[") for line in captured.out.splitlines())
    assert "warning" not in captured.out


@pytest.mark.multiprocess
def test_a_failing_worker_stops_the_others(tmp_path, capsys):
    script, out = write_script(
        tmp_path,
        """
        write_pid()
        if TASK == "worker-1":
            wait_for(OUT / "worker-0.pid")
            wait_for(OUT / "worker-2.pid")
            print("about to fail")
            sys.exit(3)
        time.sleep(120)
        """,
    )
    # If the sleepers were not stopped, the launcher would only return at its timeout (124).
    code = launch(script, [str(out)], num_workers=3, timeout=DEADLINE_S)
    captured = capsys.readouterr()
    assert code == 3, captured.err
    assert "[worker-1] about to fail" in captured.out
    assert "[launch] worker-1 exited with code 3; stopping worker-0, worker-2." in captured.err
    assert "[launch] job failed: worker-1 exited with code 3." in captured.err
    for pid in read_pids(out, ["worker-0", "worker-2"]).values():
        assert_gone(pid)


@pytest.mark.multiprocess
def test_a_worker_ignoring_sigterm_is_killed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch_lib, "_GRACE_PERIOD_S", 0.5)
    script, out = write_script(
        tmp_path,
        """
        if TASK == "worker-0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_pid()
            time.sleep(120)
        wait_for(OUT / "worker-0.pid")
        raise RuntimeError("boom")
        """,
    )
    code = launch(script, [str(out)], num_workers=2, timeout=DEADLINE_S)
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "[worker-1] RuntimeError: boom" in captured.err
    assert "worker-1 exited with code 1" in captured.err
    assert_gone(read_pids(out, ["worker-0"])["worker-0"])


@pytest.mark.multiprocess
def test_a_worker_killed_by_a_signal_fails_the_job(tmp_path, capsys):
    script, out = write_script(
        tmp_path,
        """
        if TASK == "worker-0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
        """,
    )
    code = launch(script, [str(out)], num_workers=2, timeout=DEADLINE_S)
    captured = capsys.readouterr()
    assert code == 1
    assert "worker-0 was killed by signal SIGKILL; stopping worker-1." in captured.err


@pytest.mark.multiprocess
def test_timeout_stops_everything(tmp_path, capsys):
    script, out = write_script(
        tmp_path,
        """
        write_pid()
        print("started")
        time.sleep(120)
        """,
    )
    # Long enough for both workers to start on a busy machine.
    code = launch(script, [str(out)], num_workers=2, timeout=4.0)
    captured = capsys.readouterr()
    assert code == TIMEOUT_EXIT_CODE
    assert "[launch] timed out after 4 s; stopping worker-0, worker-1." in captured.err
    for pid in read_pids(out, ["worker-0", "worker-1"]).values():
        assert_gone(pid)


@pytest.mark.multiprocess
def test_devices_per_worker_sets_xla_flags(tmp_path, capsys):
    script, out = write_script(
        tmp_path,
        """
        env = {key: os.environ.get(key) for key in ("XLA_FLAGS", "JAX_PLATFORMS")}
        (OUT / f"{TASK}.json").write_text(json.dumps(env))
        """,
    )
    inherited = "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=8"
    code = launch(
        script,
        [str(out)],
        num_workers=2,
        devices_per_worker=3,
        timeout=DEADLINE_S,
        env={"XLA_FLAGS": inherited, "JAX_PLATFORMS": "cuda"},
    )
    assert code == 0, capsys.readouterr().err
    for name in ("worker-0", "worker-1"):
        env = json.loads((out / f"{name}.json").read_text())
        assert env == {
            "XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=3",
            "JAX_PLATFORMS": "cpu",
        }


def test_free_ports_are_distinct_and_bindable():
    ports = launch_lib.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": 0}, ValueError, r"`num_workers` must be a positive int; got 0"),
        ({"num_workers": 2, "devices_per_worker": 0}, ValueError, r"`devices_per_worker` must"),
        ({"num_workers": 2, "timeout": -1}, ValueError, r"`timeout` must be a positive float"),
        ({"num_workers": 2, "script": "missing.py"}, FileNotFoundError, r"'missing.py' is not a"),
    ],
)
def test_launch_rejects(tmp_path, kwargs, error, match):
    script = tmp_path / "worker.py"
    script.write_text("")
    kwargs.setdefault("script", str(script))
    with pytest.raises(error, match=match):
        launch(**kwargs)


def test_main_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--num_workers", "0", "x.py"])
    assert exit_info.value.code == 2
    assert "--num_workers/--num-workers: must be a positive int; got '0'" in capsys.readouterr().err


def run_cli(args, **kwargs):
    # -W error: `python -m` warns when the module was imported before it ran.
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "jstrategy.launch", *args]
    return subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.mark.multiprocess
def test_cli(tmp_path):
    script, out = write_script(
        tmp_path,
        """
        print(TASK, sys.argv[2:])
        sys.exit(5 if TASK == "chief-0" else 0)
        """,
    )
    launcher = run_cli(["--num_workers", "2", "--chief", script, str(out), "--lr", "0.1"])
    stdout, stderr = launcher.communicate(timeout=DEADLINE_S)
    assert launcher.returncode == 5, stderr
    assert "RuntimeWarning" not in stderr
    assert "[chief-0] chief-0 ['--lr', '0.1']" in stdout
    assert "job failed: chief-0 exited with code 5." in stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_all_workers(tmp_path, signum):
    script, out = write_script(
        tmp_path,
        """
        write_pid()
        time.sleep(120)
        """,
    )
    launcher = run_cli(["--num_workers", "2", "--timeout", str(DEADLINE_S), script, str(out)])
    pids = {}
    try:
        end = time.monotonic() + DEADLINE_S
        while len(list(out.glob("*.pid"))) < 2 and launcher.poll() is None:
            assert time.monotonic() < end, "the workers did not start"
            time.sleep(0.05)
        pids = read_pids(out, ["worker-0", "worker-1"])
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=DEADLINE_S)
        assert launcher.returncode == 128 + signum, stderr
        assert f"received {signal.Signals(signum).name}; stopping all workers." in stderr
        for pid in pids.values():
            assert_gone(pid)
    finally:
        # Leave nothing running if the launcher misbehaved.
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
