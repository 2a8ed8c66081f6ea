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

Dropout on the attention weights (``dropout_rate`` and ``dropout_rng``, as Flax's
``MultiHeadDotProductAttention`` passes them to its ``attention_fn``) draws Flax's keep
mask, ``jax.random.bernoulli(dropout_rng, 1 - dropout_rate, shape)`` of Flax's shape, in
the step's view, laid out by query rows over the context axis: each shard keeps its rows
(``(seq / k) x seq`` booleans, per batch row and head unless ``broadcast_dropout``) and
reads one block of them at each hop. A dropped weight leaves the softmax's sum as it is and
only its value out, so the result is Flax's, number for number up to float32 rounding.

Everywhere else (other strategies, evaluation, prediction, init) it is
`flax.linen.dot_product_attention`, with ``causal=True`` adding Flax's causal mask. Inside
`strategy.run` of a strategy with a context axis it raises (`axis.refused`): there the
sequence is not split, and full attention on every device of a context group would be a
silent loss of what the axis is for.
"""

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

    A model calls it in place of ``nn.dot_product_attention`` (e.g. as the
    ``attention_fn`` of ``nn.MultiHeadDotProductAttention``, with ``causal`` bound by
    ``functools.partial``): it takes Flax's arguments, dropout's included, so Flax passes
    every one it passes its own attention. In a train step of a strategy whose mesh has a
    ``"context"`` axis (``FSDPStrategy(context=k)``) it runs ring attention over that
    axis: keys and values passed round the shards with ``ppermute``, an online softmax in
    float32, a ``(seq / k)``-square block of scores at a time, dropout with Flax's mask.
    Elsewhere it is ``nn.dot_product_attention`` with the same arguments. Inside
    ``strategy.run`` of such a strategy it raises: context parallelism engages only in
    train steps (``make_train_step``, ``Model.fit``).

    Args:
      query: ``(batch..., q_length, num_heads, head_dim)``.
      key: ``(batch..., kv_length, num_heads, head_dim)``.
      value: ``(batch..., kv_length, num_heads, v_head_dim)``.
      bias: added to the scores, as Flax's; refused under a context axis.
      mask: a boolean mask broadcastable to ``(batch..., num_heads, q_length,
        kv_length)``, as Flax's; refused under a context axis (use `causal`).
      broadcast_dropout: one dropout mask for every batch row and head, as Flax's.
      dropout_rng: the dropout key, as Flax's (needed when dropout applies).
      dropout_rate: the probability of dropping an attention weight, as Flax's.
      deterministic: no dropout, as Flax's.
      dtype: the computation's dtype, as Flax's (default: the query's). Under a context
        axis the scores and softmax are float32 and the result is cast to it.
      precision: the matrix products' precision, as Flax's.
      module: the module whose ``intermediates`` get the attention weights (Flax's
        ``sow_weights``); refused under a context axis, which never forms them whole.
      force_fp32_for_softmax: as Flax's; under a context axis the softmax is float32
        anyway.
      qk_attn_weights_einsum: the scores' einsum, as Flax's; refused under a context axis.
      attn_weights_value_einsum: the weighted values' einsum, as Flax's; refused under a
        context axis.
      causal: whether query ``i`` sees keys ``0..i`` only (self-attention: the query and
        key lengths must be equal).

    Returns:
      ``(batch..., q_length, num_heads, v_head_dim)``.

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
        return nn.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
            force_fp32_for_softmax=force_fp32_for_softmax,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum,
        )
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
    for length in (q_length, kv_length):
        if length % context.size:
            raise ValueError(
                f"Under context parallelism (context={context.size}) the attention's lengths "
                f"must divide by {context.size}; got query length {q_length} and key length "
                f"{kv_length}. Pad the sequence to a multiple of {context.size}."
            )
    out_dtype = dtype if dtype is not None else query.dtype
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
    return ring(*arrays).astype(out_dtype)


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
    """One shard's attention: its query block against every key/value block, in a ring.

    `keep` is empty, or holds this shard's rows of the dropout keep mask (every key
    column): each block's weights are multiplied by its columns over `keep_prob` where
    they weigh the values, not in the softmax's sum (Flax drops normalized weights).
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
