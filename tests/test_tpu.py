"""TPUStrategy and its setup calls, against mock TPU device descriptions as JAX's own tests do."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import jstrategy
from jstrategy._src.strategies import tpu


@dataclasses.dataclass(frozen=True)
class MockTpuDevice:
    id: int
    platform: str
    device_kind: str
    process_index: int
    coords: tuple[int, int, int]
    core_on_chip: int
    slice_index: int = 0


def mock_tpu_devices(x, y, z, kind, cores_per_chip=1, hosts=1):
    devices = []
    chips = list(itertools.product(range(x), range(y), range(z)))
    per_host = len(chips) // hosts
    for i, (cx, cy, cz) in enumerate(sorted(chips, key=lambda c: (c[2], c[1], c[0]))):
        for core in range(cores_per_chip):
            devices.append(
                MockTpuDevice(len(devices), "tpu", kind, i // per_host, (cx, cy, cz), core)
            )
    return devices


def _neighbours(a, b):
    """Adjacent on the interconnect: same chip, or chips one hop apart on one axis."""
    if a.coords == b.coords:
        return True
    return sum(abs(p - q) for p, q in zip(a.coords, b.coords, strict=True)) == 1


@pytest.mark.parametrize(
    ("shape", "kind", "cores"),
    [((2, 2, 1), "TPU v3", 2), ((2, 2, 1), "TPU v5 lite", 1), ((2, 2, 1), "TPU v4 lite", 1)],
)
def test_tray_replica_order_is_a_physical_ring(shape, kind, cores):
    devices = mock_tpu_devices(*shape, kind, cores)
    order = tpu.tpu_device_order(devices)
    assert sorted(d.id for d in order) == [d.id for d in devices]
    assert order != devices  # the input (host enumeration) order is not a ring
    ring = [*order, order[0]]
    assert all(_neighbours(a, b) for a, b in itertools.pairwise(ring))


@pytest.mark.parametrize("shape", [(2, 2, 1), (2, 2, 2), (4, 4, 4)])
def test_torus_replica_order_walks_the_physical_axes(shape):
    devices = mock_tpu_devices(*shape, "TPU v4")
    order = tpu.tpu_device_order(devices)
    assert [d.coords for d in order] == sorted(d.coords for d in devices)
    hops = sum(_neighbours(a, b) for a, b in itertools.pairwise(order))
    assert hops >= len(order) - len(order) // shape[2]  # only axis wrap-arounds are long


def test_non_tpu_devices_keep_their_order():
    import jax

    assert tpu.tpu_device_order(jax.devices()) == jax.devices()


def test_topology_from_mock_devices():
    devices = mock_tpu_devices(2, 2, 2, "TPU v4", hosts=2)
    topology = tpu.Topology.from_devices(devices)
    assert topology.mesh_shape == (2, 2, 2, 1)
    assert topology.num_tasks == 2 and topology.num_tpus_per_task == 4
    assert topology.device_coordinates.shape == (2, 4, 4)
    assert topology.device_kind == "TPU v4"


def test_no_tpu_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(tpu.ALLOW_NON_TPU_ENV, raising=False)
    with pytest.raises(
        RuntimeError, match=r"No TPU found: JAX sees cpu:0, .*JSTRATEGY_ALLOW_NON_TPU=1"
    ):
        jstrategy.TPUStrategy()
    with pytest.raises(RuntimeError, match="No TPU found"):
        jstrategy.tpu.experimental.initialize_tpu_system(
            jstrategy.cluster_resolver.TPUClusterResolver()
        )


def test_switch_runs_tpu_code_on_other_devices(monkeypatch):
    monkeypatch.setenv(tpu.ALLOW_NON_TPU_ENV, "1")
    resolver = tpu.TPUClusterResolver(tpu="")
    jstrategy.config.experimental_connect_to_cluster(resolver)  # single host: nothing to do
    topology = jstrategy.tpu.experimental.initialize_tpu_system(resolver)
    assert topology.num_tasks == 1 and topology.num_tpus_per_task == 8
    strategy = jstrategy.TPUStrategy(resolver)
    assert strategy.num_replicas_in_sync == 8
    total = strategy.run(
        lambda: jstrategy.get_replica_context().all_reduce(
            "SUM", jstrategy.get_replica_context().replica_id_in_sync_group
        )
    )
    assert int(total) == 28
    assert resolver.num_accelerators() == {}
    assert jstrategy.experimental.TPUStrategy is jstrategy.TPUStrategy


def test_strategy_over_given_devices_checks_they_are_tpu_cores(monkeypatch):
    """``devices=``: a TPU slice's cores, e.g. a topology's compile-only ones to plan for
    (tests/test_tpu_compile.py builds it over a v5e slice through libtpu)."""
    monkeypatch.delenv(tpu.ALLOW_NON_TPU_ENV, raising=False)
    with pytest.raises(ValueError, match=r"`devices` must be TPU cores; got devices of \['cpu'\]"):
        jstrategy.TPUStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=r"`devices` must be non-empty"):
        jstrategy.TPUStrategy(devices=[])
    # The switch for tests and notebooks lets other devices stand in, as without `devices`.
    monkeypatch.setenv(tpu.ALLOW_NON_TPU_ENV, "1")
    strategy = jstrategy.TPUStrategy(devices=jax.devices()[:2])
    assert strategy.num_replicas_in_sync == 2
    total = strategy.run(lambda: jstrategy.get_replica_context().all_reduce("SUM", 1.0))
    assert float(total) == 2.0


def test_resolver_and_strategy_validate():
    with pytest.raises(ValueError, match="Remote TPU nodes over gRPC are not supported"):
        tpu.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")
    with pytest.raises(ValueError, match="`experimental_device_assignment` must be None"):
        jstrategy.TPUStrategy(experimental_device_assignment=np.zeros(2))


def test_cluster_spec_from_tpu_hosts(monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-0,t1k-1")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    resolver = tpu.TPUClusterResolver()
    assert resolver.num_hosts() == 2 and resolver.task_id == 1
    assert resolver.cluster_spec().as_dict() == {"worker": ["t1k-0:8470", "t1k-1:8470"]}
