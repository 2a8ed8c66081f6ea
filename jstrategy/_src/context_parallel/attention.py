"""`dot_product_attention`: Flax's, as ring attention over a step's context axis (see
docs/ARCHITECTURE.md, "Context parallelism", for the ring, its causal skips and dropout)."""

from __future__ import annotations

from collections.abc import Callable
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
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
    attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
    *,
    causal: bool = False,
) -> jax.Array:
    """Attention as `flax.linen.dot_product_attention`, split over a context axis.

    A model calls it in place of ``nn.dot_product_attention`` (e.g. as the ``attention_fn``
    of ``nn.MultiHeadDotProductAttention``, ``causal`` bound by ``functools.partial``). In a
    train step of a strategy with a ``"context"`` axis (``FSDPStrategy(context=k)``) it
    runs ring attention over it, a ``(seq / k)``-square block of scores at a time.
    Elsewhere it is ``nn.dot_product_attention``; inside ``strategy.run`` of such a
    strategy it raises (context parallelism engages only in train steps).

    Args:
      query, key, value: ``(batch..., length, num_heads, head_dim)``, as Flax's.
      bias, mask, module, qk_attn_weights_einsum, attn_weights_value_einsum: as Flax's;
        refused under a context axis (use `causal` for a causal mask).
      broadcast_dropout, dropout_rng, dropout_rate, deterministic, precision: as Flax's.
      dtype, force_fp32_for_softmax: as Flax's; under a context axis the scores and
        softmax are float32 anyway.
      causal: whether query ``i`` sees keys ``0..i`` only (equal query and key lengths).

    Returns:
      ``(batch..., query length, num_heads, value head_dim)``.

    Raises:
      ValueError: for arrays of fewer than three dimensions, a causal attention between
        different lengths, a call inside ``strategy.run`` of a strategy with a context
        axis, or, under a context axis, a `bias`, `mask`, `module` or custom einsum, a
        length that does not divide by the context degree, or dropout without a
        `dropout_rng`.

    Example:

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jstrategy
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> out = jstrategy.experimental.dot_product_attention(q, k, v, causal=True)
    >>> out.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(out, nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(q[..., 0, 0]))))
    True
    >>> rng = jax.random.key(0)
    >>> dropped = jstrategy.experimental.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.5)
    >>> bool(jnp.array_equal(dropped, nn.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.5)))
    True
    """
    # Flax's arguments as given (all but `causal`), for the fallback to pass every one on:
    # Flax passes an `attention_fn` only the keywords its signature names.
    flax_args = {name: given for name, given in locals().items() if name != "causal"}
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
    axis_lib.refused("jstrategy.experimental.dot_product_attention")
    context = axis_lib.current()
    if context is None:
        if causal:
            causal_mask = nn.make_causal_mask(jnp.ones(query.shape[:-2], jnp.int32))
            mask = causal_mask if mask is None else nn.combine_masks(mask, causal_mask)
        return nn.dot_product_attention(**{**flax_args, "mask": mask})
    under = (
        f"under context parallelism (the {context.name!r} axis splits the sequence into "
        f"{context.size} shards)"
    )
    for name, given in (("bias", bias), ("mask", mask)):
        if given is not None:
            raise ValueError(
                f"`{name}` is not supported {under}; got an array of shape "
                f"{jnp.shape(given)}. Use causal=True for a causal mask, or train without a "
                "context axis."
            )
    if module is not None:
        raise ValueError(
            f"`module` (Flax's sow_weights=True) is not supported {under}: the ring never "
            f"forms the attention weights whole; got {type(module).__name__}. Sow them in "
            "evaluation (plain attention), or train without a context axis."
        )
    for einsum_name, einsum in (
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if einsum is not None:
            raise ValueError(
                f"`{einsum_name}` is not supported {under}: the ring computes its own "
                f"float32 products; got {einsum!r}. Leave it None, or train without a "
                "context axis."
            )
    if q_length % context.size or kv_length % context.size:
        raise ValueError(
            f"Under context parallelism (context={context.size}) the attention's lengths "
            f"must divide by {context.size}; got query length {q_length} and key length "
            f"{kv_length}. Pad the sequence to a multiple of {context.size}."
        )
    spec = P(*([None] * (query.ndim - 3)), context.name)
    arrays, specs = [query, key, value], [spec, spec, spec]
    keep_prob = None
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(
                f"`dropout_rng` is needed for `dropout_rate={dropout_rate}` with "
                "deterministic=False (as for flax.linen.dot_product_attention); got None. "
                "Pass the key (nn.MultiHeadDotProductAttention passes make_rng('dropout')), "
                "or deterministic=True."
            )
        keep_prob = 1.0 - dropout_rate
        # Flax's draw, of Flax's shape: the same mask, laid out by query rows.
        scores_shape = (*query.shape[:-3], query.shape[-2], q_length, kv_length)
        shape = (1,) * (key.ndim - 2) + scores_shape[-2:] if broadcast_dropout else scores_shape
        arrays.append(jax.random.bernoulli(dropout_rng, keep_prob, shape))
        specs.append(P(*([None] * (len(shape) - 2)), context.name, None))
    ring = jax.shard_map(
        lambda q, k, v, *keep: _ring(
            q, k, v, context, causal=causal, precision=precision, keep=keep, keep_prob=keep_prob
        ),
        mesh=context.mesh,
        in_specs=tuple(specs),
        out_specs=spec,
        # Inside the step's map over replicas, whose spmd_axis_name (the data axis) the
        # batching rule adds to these specs, so it must be manual too.
        axis_names=frozenset({context.name, context.data_axis}),
        # The online softmax's carries start invariant and become varying; the region's
        # only collectives are the ring's ppermutes, whose transposes are ppermutes.
        check_vma=False,
    )
    return ring(*arrays).astype(query.dtype if dtype is None else dtype)


def _ring(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    context: axis_lib.ContextAxis,
    *,
    causal: bool,
    precision: Any,
    keep: tuple[jax.Array, ...] = (),
    keep_prob: float | None = None,
) -> jax.Array:
    """One shard's query block against every key/value block, passed round the ring.

    `keep`: empty, or this shard's rows of the dropout keep mask; a dropped weight leaves
    the values but stays in the softmax's sum (Flax drops normalized weights).
    """
    n, name = context.size, context.name
    index = jax.lax.axis_index(name)
    q_block, kv_block = q.shape[-3], k.shape[-3]
    q_pos = index * q_block + jnp.arange(q_block)
    q32 = q.astype(jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
    heads_rows = (*q.shape[:-3], q.shape[-2], q_block)  # the scores' (batch..., h, q) axes

    # Rematerialized: differentiated as written, the scan over the hops kept every hop's
    # float32 scores and weights (a `(seq / k)`-square block a head) for the backward pass,
    # k of them at once (llama2-7B at 32k tokens, context 4 on a v5p-32: 90.76 GiB a chip,
    # 5.5x MaxText's). Recomputed, a hop keeps only its inputs.
    @jax.checkpoint
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
        if keep:
            kept = jax.lax.dynamic_slice_in_dim(keep[0], source * kv_block, kv_block, axis=-1)
            weights = weights * (kept.astype(jnp.float32) / jnp.float32(keep_prob))
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
        k, v = jax.lax.ppermute((k, v), name, ring)
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
