"""Test setup: 8 fake CPU devices, configured before JAX starts."""

# The root conftest.py sets XLA_FLAGS (8 fake CPU devices) before JAX starts.
import jax
import pytest

import jstrategy


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


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
