"""Root conftest: doctests in jstrategy/ see the same 8 fake CPU devices as tests/."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jstrategy.keras runs Keras 3 on JAX: the backend is chosen when Keras is first imported.
os.environ["KERAS_BACKEND"] = "jax"
