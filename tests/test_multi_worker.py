"""MultiWorkerMirroredStrategy with real processes on 127.0.0.1 (2 workers x 2 fake CPU devices)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jstrategy
from jstrategy._src.cross_device_ops import CollectiveAllReduce

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multi_worker_train.py"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
import custom_training_loop  # noqa: E402

STEPS = 12


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CONFIG")}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.fixture(scope="module")
def reference():
    """One process, MirroredStrategy over 4 devices: what 2 workers x 2 devices must match."""
    strategy = jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    return custom_training_loop.train(strategy, STEPS)


def _launch(tmp_path: Path, implementation: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--implementation", implementation, "--steps", str(STEPS),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker-0]" in done.stdout and "[worker-1]" in done.stdout
    assert "4 replicas over 2 workers, chief=True" in done.stdout
    assert "4 replicas over 2 workers, chief=False" in done.stdout
    return [dict(np.load(tmp_path / f"worker-{i}.npz")) for i in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
@pytest.mark.parametrize("implementation", ["AUTO", "RING", "NCCL"])
def test_two_workers_match_one_process_over_four_devices(tmp_path, reference, implementation):
    workers = _launch(tmp_path, implementation)
    ref_losses, ref_params = reference
    keys = [k for k in workers[0] if k not in ("losses", "seconds")]
    assert keys, "no parameters were saved"
    for k in keys:
        np.testing.assert_array_equal(workers[0][k], workers[1][k])  # identical on both
    flat_ref = {"/".join(p): v for p, v in _flatten(ref_params)}
    assert sorted(flat_ref) == sorted(keys)
    for k in keys:
        np.testing.assert_allclose(workers[0][k], flat_ref[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(workers[0]["losses"], ref_losses, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
# RING is the README's example (CommunicationOptions(implementation="RING")), which failed
# in fit on jax 0.12 while the invariant all-gather was read from a private name.
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_model_fit_on_two_workers_matches_one_process(tmp_path, implementation):
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--fit", "--tensorboard", str(tmp_path / "logs"),
        "--implementation", implementation,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("saved and loaded") == 2  # model.save on both workers
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    # Both workers were given the log directory; only the chief wrote it: one event file,
    # each epoch and step once.
    events = list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    assert [p.parent.name for p in events] == ["train"], events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = EventAccumulator(str(tmp_path / "logs" / "train"))
    train.Reload()
    assert [e.step for e in train.Scalars("epoch_loss")] == [0, 1, 2]
    assert [e.step for e in train.Scalars("batch_loss")] == list(range(1, 3 * 7 + 1))
    import multi_worker_train

    expected = multi_worker_train.fit_model(
        jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    )
    assert len(workers[0].files) == len(expected) > 0
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(workers[0][f"w{i}"], workers[1][f"w{i}"])
        np.testing.assert_allclose(workers[0][f"w{i}"], w, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
@pytest.mark.parametrize("fsdp", [False, True], ids=["mirrored", "fsdp"])
def test_checkpoint_saved_under_mirrored_8_restores_on_two_workers(tmp_path, fsdp):
    import jax

    mirrored = jstrategy.MirroredStrategy()
    params = {"w": np.arange(24.0, dtype=np.float32).reshape(4, 6), "b": np.ones(6, np.float32)}
    with jstrategy.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.save(3, jax.device_put(params, mirrored.replicated_sharding()))
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--restore", str(tmp_path / "ckpt"),
        *(["--fsdp"] if fsdp else []),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if fsdp:  # each worker read only its half of w, straight into FSDP's layout
        assert "worker 0: w P('replica', None), rows [0, 1] here" in done.stdout
        assert "worker 1: w P('replica', None), rows [2, 3] here" in done.stdout
    expected = jax.tree.leaves(params)
    for i in range(2):
        restored = np.load(tmp_path / f"worker-{i}.npz")
        for j, leaf in enumerate(expected):
            np.testing.assert_array_equal(restored[f"w{j}"], leaf)


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])  # a dead peer, and a stuck one
def test_failed_peer_is_a_clear_error_within_60_seconds(tmp_path, how):
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs, lines = [], [[], []]
    for i in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    "--out",
                    str(tmp_path),
                    "--forever",
                    "--timeout",
                    # It also bounds collectives: room for the workers' compile-time skew.
                    "20",
                ],
                env=_env(TF_CONFIG=tf_config, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )
        )
    readers = [
        threading.Thread(target=lambda p=p, i=i: lines[i].extend(p.stdout), daemon=True)
        for i, p in enumerate(procs)
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while not all(any("step" in line for line in out) for out in lines):
            assert time.monotonic() < deadline, f"workers never trained: {lines}"
            assert all(p.poll() is None for p in procs), f"a worker exited early: {lines}"
            time.sleep(0.2)
        procs[1].send_signal(getattr(signal, how))
        killed_at = time.monotonic()
        rc = procs[0].wait(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for reader in readers:
            reader.join(timeout=30)
        for p in procs:
            p.stdout.close()
    output = "".join(lines[0])
    print(f"survivor exited with {rc} {elapsed:.1f}s after its peer got {how}")
    assert rc != 0
    assert elapsed < 60, f"survivor took {elapsed:.0f}s to exit"
    # jstrategy's message when the failure surfaces in a step; the runtime's own otherwise.
    assert "another worker most likely died" in output or "another task died" in output, output[
        -3000:
    ]


def test_without_tf_config_it_is_local(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = jstrategy.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 8 and strategy.num_workers == 1 and strategy.is_chief
    assert isinstance(strategy.cross_device_ops, CollectiveAllReduce)


def test_evaluator_stays_out_of_training_collectives(monkeypatch):
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    )
    strategy = jstrategy.MultiWorkerMirroredStrategy()  # would block on init if it joined
    assert strategy.num_replicas_in_sync == 8 and not strategy.is_chief


def test_deprecated_experimental_form(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.warns(
        DeprecationWarning, match="experimental.MultiWorkerMirroredStrategy is deprecated"
    ):
        strategy = jstrategy.experimental.MultiWorkerMirroredStrategy(
            jstrategy.experimental.CollectiveCommunication.NCCL
        )
    assert strategy.communication_options.implementation.name == "NCCL"
    assert strategy.cross_device_ops.implementation.name == "NCCL"


@pytest.mark.parametrize("implementation", ["RING", "NCCL", "AUTO"])
@pytest.mark.parametrize("bytes_per_pack", [0, 128])
def test_collectives_agree_and_differ_in_the_program(implementation, bytes_per_pack):
    op = CollectiveAllReduce(implementation, bytes_per_pack)
    strategy = jstrategy.MirroredStrategy(
        devices=[f"cpu:{i}" for i in range(4)], cross_device_ops=op
    )
    tree = strategy.experimental_distribute_values_from_function(
        lambda ctx: {"a": np.arange(7.0, dtype=np.float32) * ctx.replica_id_in_sync_group,
                     "b": np.ones((3, 5), np.float32), "c": np.ones(2, np.float32)}
    )  # fmt: skip

    def fn(t):
        return jstrategy.get_replica_context().all_reduce("SUM", t)

    out = strategy.run(fn, (tree,))
    np.testing.assert_allclose(out["a"], np.arange(7.0) * 6)
    np.testing.assert_allclose(out["b"], np.full((3, 5), 4.0))
    import jax
    from jax.sharding import PartitionSpec as P

    text = (
        jax.jit(
            jax.shard_map(
                lambda t: op.all_reduce("SUM", t, mesh=strategy.mesh),
                mesh=strategy.mesh,
                in_specs=P(jstrategy.REPLICA_AXIS),
                out_specs=P(),
            )
        )
        .lower({k: v.value for k, v in tree.items()})
        .as_text()
    )
    tensors = 3 if bytes_per_pack == 0 else 1  # 128 bytes hold all three (96 B) in one pack

    def count(op):
        return text.count(f"stablehlo.{op}")

    if implementation == "RING":
        assert count("reduce_scatter") == tensors and count("all_gather") == tensors
        assert count("all_reduce") == 0
    else:
        assert count("all_reduce") == tensors and count("reduce_scatter") == 0


def test_communication_options_validate():
    with pytest.raises(
        ValueError, match="`implementation` must be a jstrategy.CommunicationImplementation"
    ):
        jstrategy.experimental.CommunicationOptions(implementation="carrier-pigeon")
    with pytest.raises(ValueError, match="`timeout_seconds` must be positive or None; got 0"):
        jstrategy.experimental.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="`bytes_per_pack` must be a non-negative int"):
        CollectiveAllReduce("RING", -5)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
def test_fsdp_on_two_workers_matches_one_process_over_four_devices(tmp_path):
    # FSDPStrategy joins the TF_CONFIG job the launcher describes; each worker holds half of
    # every variable (its two devices' slices), and get_weights gathers them.
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "2", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--fit", "--fsdp",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 replicas over 2 workers, chief=True" in done.stdout
    assert "4 replicas over 2 workers, chief=False" in done.stdout
    # The (10, 16) kernel is split over the 4 replicas: each process holds 2 x 40 of 160.
    assert done.stdout.count("kernel P(None, 'replica'): this process holds 80 of 160") == 2
    assert done.stdout.count("saved and loaded") == 2  # model.save of split variables
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    import multi_worker_train

    expected = multi_worker_train.fit_model(
        jstrategy.experimental.FSDPStrategy([f"cpu:{i}" for i in range(4)], min_shard_size=0)
    )
    assert len(workers[0].files) == len(expected) > 0
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(workers[0][f"w{i}"], workers[1][f"w{i}"])
        np.testing.assert_allclose(workers[0][f"w{i}"], w, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
@pytest.mark.parametrize(
    ("mesh", "replicas", "pieces"),
    [
        # "batch" crosses the processes: each is one replica, one slice per device.
        ("batch2xmodel4", 2, "kernel pieces here: 4 of 160 elements, 40 per device"),
        # "model" crosses them: each process holds one half of the kernel, on 4 replicas.
        ("model2xbatch4", 4, "kernel pieces here: 1 of 80 elements, 80 per device"),
    ],
)
def test_model_parallel_on_two_workers_matches_one_process_over_eight_devices(
    tmp_path, mesh, replicas, pieces
):
    # ModelParallelStrategy joins the TF_CONFIG job; its (2, 4) mesh spans both processes'
    # devices, the first axis across them. Fit, get_weights (gathered), model.save and
    # load_model are one process's over 8 devices.
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--fit", "--model-parallel", mesh,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{replicas} replicas over 2 workers, chief=True" in done.stdout
    assert f"{replicas} replicas over 2 workers, chief=False" in done.stdout
    assert done.stdout.count("processes [[0, 0, 0, 0], [1, 1, 1, 1]]") == 2
    # The (10, 16) first kernel is split over "model"; each process holds only its pieces.
    assert done.stdout.count("kernel P(None, 'model')") == 2
    assert done.stdout.count(pieces) == 2, done.stdout[-3000:]
    assert done.stdout.count("saved and loaded") == 2  # model.save of split variables
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    import multi_worker_train

    expected = multi_worker_train.fit_model(multi_worker_train.model_parallel_strategy(mesh))
    assert len(workers[0].files) == len(expected) > 0
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(workers[0][f"w{i}"], workers[1][f"w{i}"])
        np.testing.assert_allclose(workers[0][f"w{i}"], w, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
def test_checkpoint_saved_under_model_parallel_8_restores_on_two_workers(tmp_path):
    # Written by one process over 8 devices; restored by 2 workers x 4 devices, the "model"
    # axis across the processes: each worker reads (and holds) its half of w and b only.
    import jax
    import multi_worker_train

    saver = multi_worker_train.model_parallel_strategy("model2xbatch4", checkpoint=True)
    params = {
        "w": np.arange(32.0, dtype=np.float32).reshape(4, 8),
        "b": np.arange(8, dtype=np.float32) + 0.5,
    }
    placed = {k: jax.device_put(v, saver.variable_sharding(v, (k,))) for k, v in params.items()}
    assert placed["w"].sharding.spec == jax.sharding.PartitionSpec("model", None)
    with jstrategy.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.save(3, placed)
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--restore", str(tmp_path / "ckpt"),
        "--model-parallel", "model2xbatch4",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "worker 0: w P('model', None), rows [0, 1] here" in done.stdout
    assert "worker 1: w P('model', None), rows [2, 3] here" in done.stdout
    assert "worker 0: b P('model',), rows [0, 1, 2, 3] here" in done.stdout
    assert "worker 1: b P('model',), rows [4, 5, 6, 7] here" in done.stdout
    expected = jax.tree.leaves(params)
    for i in range(2):
        restored = np.load(tmp_path / f"worker-{i}.npz")
        for j, leaf in enumerate(expected):
            np.testing.assert_array_equal(restored[f"w{j}"], leaf)


@pytest.mark.multiprocess
@pytest.mark.timeout(320)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_on_two_workers_one_stage_each_matches_one_process(tmp_path, schedule):
    # PipelineStrategy joins the TF_CONFIG job; its (2, 4) mesh puts one stage on each
    # process, so the microbatches cross between the processes by ppermute. Each process
    # holds (and saves, and loads back) its stage's layers; the weights are one process's
    # over 8 devices.
    cmd = [
        sys.executable, "-m", "jstrategy.launch", "--num_workers", "2",
        "--devices_per_worker", "4", "--timeout", "240", str(WORKER),
        "--out", str(tmp_path), "--fit", "--pipeline", schedule,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("processes [[0, 0, 0, 0], [1, 1, 1, 1]]") == 2
    assert "stacked kernel P('stage', None, None): layers [0, 1] here" in done.stdout
    assert "stacked kernel P('stage', None, None): layers [2, 3] here" in done.stdout
    assert done.stdout.count("saved and loaded") == 2
    workers = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    import multi_worker_train

    expected = multi_worker_train.fit_pipelined(multi_worker_train.pipeline_strategy(schedule))
    assert len(workers[0].files) == len(expected) > 0
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(workers[0][f"w{i}"], workers[1][f"w{i}"])
        np.testing.assert_allclose(workers[0][f"w{i}"], w, rtol=1e-5, atol=1e-5)
