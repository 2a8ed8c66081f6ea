"""TF-style device strings resolved to `jax.Device` objects."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeAlias

import jax

from jstrategy._src.validation import is_int

__all__ = ["DeviceSpec", "canonical_name", "compile_only", "resolve_device", "resolve_devices"]

DeviceSpec: TypeAlias = str | jax.Device

# TF's device types, in the names JAX's backends use.
_PLATFORM_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_DEVICE_PART = re.compile(r"^(?:device:)?(?P<type>[a-zA-Z_]+):(?P<index>\d+)$")
_FIELD_PART = re.compile(r"^(?P<key>job|replica|task):(?P<value>[\w.-]+)$")


def _platform_of(device: jax.Device) -> str:
    # JAX reports "cuda"/"rocm" for GPUs; TF calls them all GPU.
    return _PLATFORM_ALIASES.get(device.platform, device.platform)


def canonical_name(device: jax.Device) -> str:
    """The short TF-style name of `device`, e.g. ``"cpu:0"`` or ``"gpu:3"``.

    The index is the device's position among its process's devices of that platform, which
    is what ``"/gpu:3"`` means in TensorFlow.
    """
    platform = _platform_of(device)
    same = [d for d in _local_devices(platform) if d.process_index == device.process_index]
    index = same.index(device) if device in same else device.id
    return f"{platform}:{index}"


def compile_only(device: jax.Device) -> bool:
    """Whether JAX can compile for `device` but not run on it: a TPU topology's device
    (`jstrategy.experimental.topology_devices`), which no backend of this process has.

    Example:

    >>> import jax
    >>> compile_only(jax.devices()[0])
    False
    """
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend for the platform here (a topology's, without it)
        return True


def _local_devices(platform: str) -> list[jax.Device]:
    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []


def _available() -> str:
    names = []
    for platform in ("tpu", "gpu", "cpu"):
        names += [canonical_name(d) for d in _local_devices(platform) if d.process_index == 0]
    return ", ".join(names) or "none"


def _parse(spec: str) -> tuple[str, int, int | None]:
    text = spec.strip().strip("/")
    platform: str | None = None
    index = 0
    task: int | None = None
    for part in text.split("/") if text else []:
        field_match = _FIELD_PART.match(part)
        device_match = _DEVICE_PART.match(part)
        if field_match:
            if field_match["key"] == "task":
                task = int(field_match["value"])
        elif device_match:
            platform = device_match["type"].lower()
            index = int(device_match["index"])
        else:
            platform = None
            break
    if platform not in _PLATFORM_ALIASES:
        raise ValueError(
            f"`device` must be a jax.Device or a TF-style device string such as '/gpu:0', "
            f"'GPU:0', '/device:CPU:0' or '/job:localhost/replica:0/task:0/device:CPU:0'; "
            f"got {spec!r}. Available devices: {_available()}."
        )
    return _PLATFORM_ALIASES[platform], index, task


def resolve_device(spec: DeviceSpec) -> jax.Device:
    """Resolves a TF-style device string, or a `jax.Device`, to a `jax.Device`.

    Args:
      spec: a `jax.Device`, or a string such as ``"/gpu:0"``, ``"GPU:0"``,
        ``"/device:GPU:0"``, ``"/job:localhost/replica:0/task:0/device:CPU:0"``,
        ``"cpu:3"`` or ``"tpu:1"``. The index counts the devices of that platform in the
        process named by ``task`` (this process when no task is given).

    Returns:
      The `jax.Device`.

    Raises:
      ValueError: if the string is malformed or names a device that does not exist; the
        message lists the devices that do.

    Example:

    >>> resolve_device("/job:localhost/replica:0/task:0/device:CPU:1")
    CpuDevice(id=1)
    """
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"`device` must be a jax.Device or a device string like '/gpu:0'; got "
            f"{type(spec).__name__} {spec!r}."
        )
    platform, index, task = _parse(spec)
    process = jax.process_index() if task is None else task
    candidates = [d for d in _local_devices(platform) if d.process_index == process]
    if index >= len(candidates):
        raise ValueError(
            f"Device {spec!r} does not exist: {platform} process {process} has "
            f"{len(candidates)} {platform} device(s). Available devices: {_available()}."
        )
    return candidates[index]


def resolve_devices(specs: Sequence[DeviceSpec], *, argument: str = "devices") -> list[jax.Device]:
    """Resolves several device specs and checks they form a valid replica group.

    Args:
      specs: device strings or `jax.Device` objects.
      argument: the argument name to use in error messages.

    Returns:
      The devices, in the given order.

    Raises:
      TypeError: if `specs` is not a sequence (e.g. a device count).
      ValueError: if `specs` is empty, names a device twice, mixes platforms, or names a
        device that does not exist.
    """
    if isinstance(specs, (str, jax.Device)):
        specs = [specs]
    try:
        specs = list(specs)
    except TypeError:
        hint = ""
        if is_int(specs):
            hint = f" To use {specs} devices, pass {argument}=jax.local_devices()[:{specs}]."
        raise TypeError(
            f"`{argument}` must be a list of devices (TF-style strings such as '/gpu:0', or "
            f"jax.Device objects); got {type(specs).__name__} {specs!r}. Pass e.g. "
            f"{argument}=['/gpu:0', '/gpu:1'], or {argument}=None for all local devices.{hint}"
        ) from None
    if not specs:
        raise ValueError(
            f"`{argument}` must be non-empty; got []. Pass {argument}=None to use all local "
            "devices."
        )
    devices = [resolve_device(s) for s in specs]
    seen: dict[jax.Device, int] = {}
    for i, d in enumerate(devices):
        if d in seen:
            raise ValueError(
                f"`{argument}` must not name a device twice; {specs[seen[d]]!r} and "
                f"{specs[i]!r} are both {canonical_name(d)}. Remove the duplicate."
            )
        seen[d] = i
    platforms = sorted({_platform_of(d) for d in devices})
    if len(platforms) > 1:
        raise ValueError(
            f"`{argument}` must all be of one platform; got {platforms} in {specs!r}. "
            "Replicas of one strategy run the same compiled program, so pick devices of a "
            "single platform."
        )
    return devices
