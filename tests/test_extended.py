"""`strategy.extended` (TF's device and ownership queries) and the namespaces a bare
``import jstrategy`` reaches."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jstrategy


def test_extended_devices_follow_where_variables_live():
    mirrored = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert mirrored.extended.worker_devices == mirrored.devices
    assert mirrored.extended.parameter_devices == mirrored.devices
    central = jstrategy.CentralStorageStrategy()
    assert central.extended.worker_devices == central.devices
    assert [str(d) for d in central.extended.parameter_devices] == ["cpu:0"]
    one = jstrategy.OneDeviceStrategy("cpu:3")
    assert [str(d) for d in one.extended.parameter_devices] == ["cpu:3"]


def test_variable_created_in_scope():
    mirrored = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    central = jstrategy.CentralStorageStrategy()
    with mirrored.scope():
        model = jstrategy.Sequential([jstrategy.layers.Dense(2, input_shape=(3,))])
    kernel = model.variables["params"]["dense"]["kernel"]
    assert mirrored.extended.variable_created_in_scope(model)
    assert mirrored.extended.variable_created_in_scope(kernel)
    assert not central.extended.variable_created_in_scope(model)
    assert not central.extended.variable_created_in_scope(kernel)
    assert not mirrored.extended.variable_created_in_scope(jax.device_put(jnp.ones(3)))
    with pytest.raises(TypeError, match="`v` must be a variable"):
        mirrored.extended.variable_created_in_scope("kernel")


@pytest.mark.multiprocess
def test_training_and_coordinator_reachable_after_bare_import():
    code = (
        "import jstrategy; "
        "print(jstrategy.training.TrainState.__name__, "
        "jstrategy.coordinator.ClusterCoordinator.__name__, jstrategy.Sequential.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TrainState", "ClusterCoordinator", "Sequential"]
