"""Devices to plan for without having them: a TPU topology's compile-only devices.

`jstrategy.experimental.plan` compiles for the strategy's mesh; a strategy built over
these devices (``FSDPStrategy(devices=topology_devices("v5e:16x16"))``) plans a slice this
process does not have. What JAX can compile for so, and what it cannot, is said here once.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import topologies

__all__ = ["topology_devices"]


def topology_devices(topology: str, *, platform: str = "tpu") -> list[Any]:
    """The compile-only devices of an accelerator topology, to plan a mesh not at hand.

    JAX compiles for a topology's devices without having them (as MaxText's
    ``train_compile.py`` does): build a strategy over them and pass it to
    `jstrategy.experimental.plan`. Nothing can run on them. In JAX 0.12 only TPU
    topologies are offered, through libtpu (the package ``jax[tpu]`` installs; no TPU is
    needed); CPU and GPU have none. For a CPU plan of N devices, run the plan in a
    process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.

    Args:
      topology: the topology's name, e.g. ``"v5e:4x4"``, ``"v4:2x2x2"``, ``"v5p:2x2x4"``.
      platform: ``"tpu"``, the one platform JAX 0.12 compiles for without devices.

    Returns:
      The topology's devices (``jax.Device`` objects for compiling only).

    Raises:
      ValueError: for a platform JAX has no topologies for, or a TPU topology without
        libtpu installed, each naming the limit and the fix.

    Example:

    >>> import jstrategy
    >>> try:
    ...     jstrategy.experimental.topology_devices("4", platform="cpu")
    ... except ValueError as e:
    ...     print(str(e)[:60])
    JAX cannot compile for cpu devices this process does not hav
    """
    if not isinstance(topology, str) or not topology:
        raise TypeError(
            f"`topology` must be a topology's name such as 'v5e:4x4'; got {topology!r}."
        )
    try:
        return list(topologies.get_topology_desc(topology, platform).devices)
    except NotImplementedError as e:
        raise ValueError(
            f"JAX cannot compile for {platform} devices this process does not have: it "
            f"offers topologies for TPU only (jax {jax.__version__}: {e}). Plan for N CPU "
            "devices in a process started with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N, or pass platform='tpu' "
            "with a TPU topology's name."
        ) from e
    except RuntimeError as e:
        if platform == "tpu" and "not installed" in str(e):
            raise ValueError(
                f"Compiling for the TPU topology {topology!r} needs libtpu in this "
                "environment (no TPU is needed): pip install libtpu, at the version "
                f"jax[tpu]=={jax.__version__} pins. JAX said: {e}"
            ) from e
        raise
