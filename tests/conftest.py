"""Test setup: 8 fake CPU devices, configured before JAX starts."""

# The root conftest.py sets XLA_FLAGS (8 fake CPU devices) before JAX starts.
import gc
import threading
import time

import jax
import psutil
import pytest

import jstrategy

# The scripts that record Keras 3's reference numbers import Keras, which is not a test
# dependency: they are run by hand (see each script), never collected.
collect_ignore = ["reference"]


def _strategies():
    """Every strategy column of the design table that runs in one process on CPU."""
    return {
        "one_device": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        "mirrored_1": lambda: jstrategy.MirroredStrategy(devices=["cpu:0"]),
        "mirrored_2": lambda: jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"]),
        "mirrored_4": lambda: jstrategy.MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)]),
        "mirrored_8": lambda: jstrategy.MirroredStrategy(),
        "mirrored_8_hierarchical": lambda: jstrategy.MirroredStrategy(
            cross_device_ops=jstrategy.HierarchicalCopyAllReduce()
        ),
        "mirrored_8_one_device": lambda: jstrategy.MirroredStrategy(
            cross_device_ops=jstrategy.ReductionToOneDevice()
        ),
        "mirrored_8_nccl_unpacked": lambda: jstrategy.MirroredStrategy(
            cross_device_ops=jstrategy.NcclAllReduce(num_packs=0)
        ),
        "central_storage_1": lambda: jstrategy.CentralStorageStrategy(compute_devices=["cpu:0"]),
        "central_storage_8": lambda: jstrategy.CentralStorageStrategy(),
        "fsdp_8": lambda: jstrategy.experimental.FSDPStrategy(min_shard_size=0),
        "model_parallel_2x4": _model_parallel_2x4,
    }


def _model_parallel_2x4():
    """Two replicas of four devices: a Megatron MLP's kernels split over "model".

    The keys match the first and second dense layers of the suites' linen (``Dense_0``)
    and NNX (``dense1``) models. Models use ``strategy.axis_name`` (``"batch"`` here) for
    their collectives, e.g. BatchNorm's.
    """
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["(Dense_0|dense1)/kernel"] = (None, "model")
    layout_map["(Dense_1|dense2)/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


STRATEGIES = _strategies()


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request):
    """Each strategy in turn: the one parameterized suite runs over all of them."""
    return STRATEGIES[request.param]()


@pytest.fixture
def one_device():
    """The oracle every strategy's trajectory is compared with."""
    return jstrategy.OneDeviceStrategy("cpu:0")


@pytest.fixture
def shut_down_coordinators():
    """``stop(strategy)``: the ParameterServerStrategy's coordinator is shut down after the test.

    `Model.fit` under a ParameterServerStrategy starts the strategy's ClusterCoordinator, whose
    worker threads live as long as the strategy (as TF's do); a test hands its strategies
    here so that they end with it.
    """
    strategies = []
    yield strategies.append
    for strategy in strategies:
        if strategy._coordinator is not None:
            strategy._coordinator.shutdown()


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


# Threads a library starts once per process and keeps for reuse: not a test's leak. Each is
# named here with who starts it.
_PROCESS_POOLS = (
    # concurrent.futures pools inside orbax (async checkpointing) and ray's client, reused.
    "ThreadPoolExecutor-",
    # pytest-timeout's and pytest-xdist's own threads (execnet's receiver).
    "pytest_timeout",
    "execnet",
)
# How long a test's threads and processes get to finish after it returns: a join or a
# terminate that was asked for is on its way, so this bounds only the wait, not a leak.
_LEAK_GRACE_SECONDS = 10.0


def _started_since(before_threads, before_children):
    threads = [
        t
        for t in threading.enumerate()
        if t.ident not in before_threads and t.is_alive() and not t.name.startswith(_PROCESS_POOLS)
    ]
    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in before_children and child.status() != psutil.STATUS_ZOMBIE:
                children.append(child)
        except psutil.NoSuchProcess:
            pass
    return threads, children


@pytest.fixture(autouse=True)
def _no_leaked_threads_or_processes(request):
    """Fails the test that leaves a thread or a child process running into the next one.

    A coordinator, Ray actor or worker process that outlives its test keeps dispatching
    programs over the same fake devices while the next test runs its collectives: that is how
    a loaded run once lost a pytest-xdist worker to XLA's rendezvous abort.
    """
    before_threads = {t.ident for t in threading.enumerate()}
    before_children = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + _LEAK_GRACE_SECONDS
    threads, children = _started_since(before_threads, before_children)
    if threads:
        # What the test no longer reaches may hold threads that end when it is collected
        # (a ClusterCoordinator, say); reference cycles wait for the cyclic collector.
        gc.collect()
    while (threads or children) and time.monotonic() < deadline:
        time.sleep(0.05)
        threads, children = _started_since(before_threads, before_children)
    if threads or children:
        processes = []
        for child in children:  # named, then killed so that the next test starts clean
            try:
                processes.append(" ".join(child.cmdline()[:3]))
                child.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(
            f"{request.node.nodeid} left running after it returned: threads "
            f"{sorted(t.name for t in threads)}, processes {sorted(processes)}. "
            "Stop what the test started (coordinator.shutdown(), a context manager, "
            "process.join()) before it returns.",
            pytrace=False,
        )
