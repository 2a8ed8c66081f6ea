"""`dot_product_attention`: Flax's attention, as ring attention over a step's context axis.

Under a train step whose strategy splits the sequence (`axis.current()` is set, see
`context_parallel/axis.py`), each shard of the context axis holds a contiguous block of
the queries, keys and values. The attention runs in a `jax.shard_map` manual over the
context axis (and the step's data axis, the map over replicas it runs in): each shard
computes its queries against its own key/value block, then passes its keys and values on
round the ring (`jax.lax.ppermute`, shard ``i`` to ``i + 1``) ``k - 1`` times, combining the
blocks with an online softmax in float32 (flash attention's running maximum and sum). No
device ever holds more than a ``(seq / k) x (seq / k)`` block of scores, so the
activations the backward pass keeps fall with the square of the sequence over ``k``.

Causal masks are computed from the blocks' true positions; a block entirely in a query
block's future is skipped (`jax.lax.cond`). The work is not load-balanced: the shard with
the last positions computes ``k`` blocks, the first one.

Everywhere else (other strategies, evaluation, prediction, init) it is
`flax.linen.dot_product_attention`, with ``causal=True`` adding Flax's causal mask.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jstrategy._src.context_parallel import axis as axis_lib
from jstrategy._src.validation import check_bool

__all__ = ["dot_product_attention"]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    dtype: Any = None,
    precision: Any = None,
) -> jax.Array:
    """Attention as `flax.linen.dot_product_attention`, split over a context axis.

    A model calls it in place of ``nn.dot_product_attention`` (e.g. as the
    ``attention_fn`` of ``nn.MultiHeadDotProductAttention``, with ``causal`` bound by
    ``functools.partial``). In a train step of a strategy whose mesh has a ``"context"``
    axis (``FSDPStrategy(context=k)``) it runs ring attention over that axis: keys and
    values passed round the shards with ``ppermute``, an online softmax in float32, a
    ``(seq / k)``-square block of scores at a time. Elsewhere it is
    ``nn.dot_product_attention(query, key, value, bias, mask, ...)``.

    Args:
      query: ``(batch..., q_length, num_heads, head_dim)``.
      key: ``(batch..., kv_length, num_heads, head_dim)``.
      value: ``(batch..., kv_length, num_heads, v_head_dim)``.
      bias: added to the scores, as Flax's; refused under a context axis.
      mask: a boolean mask broadcastable to ``(batch..., num_heads, q_length,
        kv_length)``, as Flax's; refused under a context axis (use `causal`).
      causal: whether query ``i`` sees keys ``0..i`` only (self-attention: the query and
        key lengths must be equal).
      dtype: the computation's dtype, as Flax's (default: the query's). Under a context
        axis the scores and softmax are float32 and the result is cast to it.
      precision: the matrix products' precision, as Flax's.

    Returns:
      ``(batch..., q_length, num_heads, v_head_dim)``.

    Raises:
      ValueError: for arrays of fewer than three dimensions, a causal attention between
        different lengths, or, under a context axis, a `bias` or `mask`, or a length that
        does not divide by the context degree.

    Example:

    >>> import jax.numpy as jnp, flax.linen as nn
    >>> import jstrategy
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> out = jstrategy.experimental.dot_product_attention(q, k, v, causal=True)
    >>> out.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(out, nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(q[..., 0, 0]))))
    True
    """
    check_bool(causal, "causal")
    for name, array in (("query", query), ("key", key), ("value", value)):
        if jnp.ndim(array) < 3:
            raise ValueError(
                f"`{name}` must be shaped (batch..., length, num_heads, head_dim), as for "
                f"flax.linen.dot_product_attention; got shape {jnp.shape(array)}. Split "
                "the features into heads first (e.g. with nn.DenseGeneral)."
            )
    q_length, kv_length = query.shape[-3], key.shape[-3]
    if causal and q_length != kv_length:
        raise ValueError(
            f"`causal=True` is self-attention: the query's length must equal the key's; "
            f"got {q_length} and {kv_length}. Pass a `mask` for other patterns."
        )
    context = axis_lib.current()
    if context is None:
        if causal:
            causal_mask = nn.make_causal_mask(jnp.ones(query.shape[:-2], jnp.int32))
            mask = causal_mask if mask is None else nn.combine_masks(mask, causal_mask)
        return nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, dtype=dtype, precision=precision
        )
    for name, given in (("bias", bias), ("mask", mask)):
        if given is not None:
            raise ValueError(
                f"`{name}` is not supported under context parallelism (the {context.name!r} "
                f"axis splits the sequence into {context.size} shards); got an array of shape "
                f"{jnp.shape(given)}. Use causal=True for a causal mask, or train without a "
                "context axis."
            )
    for length in (q_length, kv_length):
        if length % context.size:
            raise ValueError(
                f"Under context parallelism (context={context.size}) the attention's lengths "
                f"must divide by {context.size}; got query length {q_length} and key length "
                f"{kv_length}. Pad the sequence to a multiple of {context.size}."
            )
    out_dtype = dtype if dtype is not None else query.dtype
    spec = P(*([None] * (query.ndim - 3)), context.name)
    ring = jax.shard_map(
        lambda q, k, v: _ring(q, k, v, context, causal=causal, precision=precision),
        mesh=context.mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        # Inside the step's map over replicas, whose spmd_axis_name (the data axis) the
        # batching rule adds to these specs, so it must be manual too.
        axis_names=frozenset({context.name, context.data_axis}),
        # The online softmax's carries start invariant and become varying; the region's
        # only collectives are the ring's ppermutes, whose transposes are ppermutes.
        check_vma=False,
    )
    return ring(query, key, value).astype(out_dtype)


def _ring(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    context: axis_lib.ContextAxis,
    *,
    causal: bool,
    precision: Any,
) -> jax.Array:
    """One shard's attention: its query block against every key/value block, in a ring."""
    n, name = context.size, context.name
    index = jax.lax.axis_index(name)
    q_block, kv_block = q.shape[-3], k.shape[-3]
    q_pos = index * q_block + jnp.arange(q_block)
    q32 = q.astype(jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
    heads_rows = (*q.shape[:-3], q.shape[-2], q_block)  # the scores' (batch..., h, q) axes

    def attend(carry: Any, k: jax.Array, v: jax.Array, source: jax.Array) -> Any:
        out, top, total = carry
        scores = jnp.einsum(
            "...qhd,...khd->...hqk", q32, k.astype(jnp.float32), precision=precision
        )
        if causal:
            kv_pos = source * kv_block + jnp.arange(kv_block)
            seen = q_pos[:, None] >= kv_pos[None, :]
            scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        weights = jnp.exp(scores - new_top[..., None])
        scale = jnp.exp(top - new_top)
        total = total * scale + weights.sum(axis=-1)
        out = out * jnp.swapaxes(scale, -1, -2)[..., None] + jnp.einsum(
            "...hqk,...khd->...qhd", weights, v.astype(jnp.float32), precision=precision
        )
        return out, new_top, total

    start = (
        jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32),
        jnp.full(heads_rows, -jnp.inf, jnp.float32),
        jnp.zeros(heads_rows, jnp.float32),
    )
    # The shard's own block first: under a causal mask it holds every query's diagonal, so
    # each row's running maximum is finite from then on.
    carry = attend(start, k, v, index)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def step(state: Any, hop: jax.Array) -> Any:
        carry, k, v = state
        k = jax.lax.ppermute(k, name, ring)
        v = jax.lax.ppermute(v, name, ring)
        source = (index - hop) % n  # the shard whose block arrived after `hop` hops
        if causal:
            # A block whose every key is in the future of every query adds nothing.
            carry = jax.lax.cond(
                source <= index, lambda c: attend(c, k, v, source), lambda c: c, carry
            )
        else:
            carry = attend(carry, k, v, source)
        return (carry, k, v), None

    (carry, _, _), _ = jax.lax.scan(step, (carry, k, v), jnp.arange(1, n))
    out, _, total = carry
    return out / jnp.swapaxes(total, -1, -2)[..., None]
