"""TF-style device strings."""

import jax
import pytest

import jstrategy
from jstrategy._src import devices


@pytest.mark.parametrize(
    ("spec", "index"),
    [
        ("/cpu:0", 0),
        ("CPU:1", 1),
        ("/device:CPU:2", 2),
        ("/job:localhost/replica:0/task:0/device:CPU:3", 3),
        ("cpu:7", 7),
        ("  /CPU:4 ", 4),
    ],
)
def test_tf_device_strings_resolve(spec, index):
    assert devices.resolve_device(spec) == jax.devices("cpu")[index]


def test_jax_device_passes_through():
    d = jax.devices()[5]
    assert devices.resolve_device(d) is d
    assert jstrategy.OneDeviceStrategy(d).device is d


@pytest.mark.parametrize("spec", ["/gpu:0", "GPU:0", "/device:GPU:0", "tpu:1"])
def test_missing_platform_lists_available_devices(spec):
    with pytest.raises(ValueError, match=r"does not exist.*Available devices: .*cpu:0"):
        devices.resolve_device(spec)


def test_index_out_of_range_lists_available_devices():
    with pytest.raises(ValueError, match=r"'cpu:8' does not exist.*8 cpu device\(s\).*cpu:7"):
        devices.resolve_device("cpu:8")


@pytest.mark.parametrize("spec", ["", "banana", "/device:CPU", "cpu:x", "/job:w/task:0/foo"])
def test_malformed_strings(spec):
    with pytest.raises(ValueError, match="TF-style device string"):
        devices.resolve_device(spec)


def test_non_string_is_type_error():
    with pytest.raises(TypeError, match="`device` must be a jax.Device or a device string"):
        devices.resolve_device(3)


def test_task_selects_process():
    assert devices.resolve_device("/job:worker/task:0/device:CPU:1") == jax.devices()[1]
    with pytest.raises(ValueError, match="process 1 has 0 cpu"):
        devices.resolve_device("/job:worker/task:1/device:CPU:0")


def test_mirrored_device_validation():
    with pytest.raises(
        ValueError, match=r"`devices` must be non-empty; got \[\]\. Pass devices=None"
    ):
        jstrategy.MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="must not name a device twice; '/cpu:1' and 'CPU:1'"):
        jstrategy.MirroredStrategy(devices=["/cpu:1", "CPU:1"])
    with pytest.raises(ValueError, match="does not exist"):
        jstrategy.MirroredStrategy(devices=["cpu:0", "gpu:0"])
    # TF habit: a device count is not a device list.
    with pytest.raises(
        TypeError,
        match=r"`devices` must be a list of devices .* got int 3\. .* "
        r"devices=jax\.local_devices\(\)\[:3\]",
    ):
        jstrategy.MirroredStrategy(devices=3)


def test_mirrored_defaults_to_all_local_devices():
    strategy = jstrategy.MirroredStrategy()
    assert strategy.devices == tuple(jax.local_devices())
    assert strategy.num_replicas_in_sync == 8
    assert strategy.mesh.axis_names == (jstrategy.REPLICA_AXIS,)


def test_canonical_name():
    assert devices.canonical_name(jax.devices()[3]) == "cpu:3"
    assert "cpu:0" in repr(jstrategy.OneDeviceStrategy("cpu:0"))
