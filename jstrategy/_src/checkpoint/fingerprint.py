"""A 32-bit fingerprint of each saved leaf's bits, computed where the leaf lives.

Saved in the record beside each leaf and recomputed on restore, so a damaged file gives
`CheckpointError` rather than wrong weights: orbax and tensorstore read a checkpoint whose
data bytes were overwritten without any error.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import dispatch
from jstrategy._src.placement import in_device_memory

__all__ = [
    "fingerprint_np",
    "leaf_fingerprints",
]


# Sub-byte types pack several elements per byte on devices: not bitcast per element.
_SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def _hashable_dtype(dtype: np.dtype) -> bool:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or dtype.name in _SUB_BYTE:
        return False
    if np.issubdtype(dtype, np.complexfloating):
        return dtype.itemsize in (8, 16)
    return dtype.itemsize in (1, 2, 4, 8) and dtype.kind in "biufV"


def _mix(u: Any, xp: Any) -> Any:
    # A position-dependent 32-bit mix (murmur3's finalizer), summed with wraparound: a
    # changed, moved or truncated element changes the sum, except with chance 2**-32.
    i = xp.arange(u.shape[0], dtype=xp.uint32)
    h = u * xp.uint32(0x9E3779B1) + i * xp.uint32(0x85EBCA77) + xp.uint32(1)
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * xp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return xp.sum(h, dtype=xp.uint32)


def _words_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    if np.issubdtype(x.dtype, np.complexfloating):
        x = x.view(np.float32 if x.dtype.itemsize == 8 else np.float64)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
    return x.view(unsigned).astype(np.uint32)


def _words_jax(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    size = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    # An 8-byte element becomes two words, low word first, as NumPy's view on little-endian.
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


def fingerprint_np(x: np.ndarray) -> int:
    return int(_mix(_words_np(x), np))


@jax.jit
def _fingerprint_jax(x: jax.Array) -> jax.Array:
    return _mix(_words_jax(x), jnp)


def leaf_fingerprints(leaves: list[Any]) -> list[int | None]:
    """One fingerprint per leaf (None where the dtype has no fixed-width bits)."""
    out: list[Any] = [None] * len(leaves)
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            if _hashable_dtype(np.dtype(x.dtype)):
                # One small program per leaf rather than one for the whole state: it compiles
                # once per distinct shape, dtype and sharding (a model repeats a few), where a
                # program over hundreds of leaves took seconds to compile.
                out[i] = _fingerprint_jax(in_device_memory(x))
                # Sharded leaves all-reduce their partial sums: keep the queue short.
                dispatch.track(out[i])
        else:
            a = np.asarray(x)
            if _hashable_dtype(a.dtype):
                out[i] = fingerprint_np(a)
    return [None if v is None else int(v) for v in jax.device_get(out)]
