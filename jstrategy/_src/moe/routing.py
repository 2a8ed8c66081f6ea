"""Top-k routing of tokens to experts: capacity, dispatch and combine masks, aux losses.

The definitions follow MaxText's ``layers/moe.py`` (dense-matmul path) and Switch
Transformer, with the group of tokens that shares a capacity being ONE example row:

* Each row of the input (``[rows, tokens, features]``; a ``[rows, features]`` input is one
  token a row) is routed on its own. Its capacity per expert is
  ``max(ceil(tokens * top_k / num_experts) * capacity_factor, capacity_factor)``, cut to
  an int, MaxText's ``expert_capacity_per_batch`` (its groups are batch rows too).
* Token order for drops: a row's assignments are taken token-major, then by rank (token
  0's first choice, token 0's second, token 1's first, ...); an expert keeps the first
  ``capacity`` assignments it gets and drops the rest (MaxText's cumulative sum over the
  fused ``seq * top_k`` axis). A dropped assignment adds nothing to the token's output
  (the kept weights are not renormalized).
* Load balance (Switch): per row, ``num_experts * sum_e f_e * P_e``
  with ``f_e`` the mean over the row's tokens of how many of its top-k picks are expert
  ``e`` (summing to ``top_k``) and ``P_e`` the mean router probability (the softmax over
  all experts); a balanced router scores ``top_k``. MaxText 0.2.5 divides ``f_e`` by
  ``top_k`` and averages its layers' terms where the train step sums them: a weight of
  ``w / (top_k * layers)`` here adds its ``load_balance_loss_weight=w`` term
  (docs/benchmarks.md, "Mixture of experts beside MaxText").
* Router z-loss (ST-MoE): per row, the mean over its tokens of ``logsumexp(logits) ** 2``.

Because a row's routing depends only on that row, the drops, outputs and losses of a
row are the same whichever replica holds it: data parallelism over rows follows one
device exactly. Dropless routing (``capacity_factor=None``) gives each expert room for
every token of the row (a token picks an expert at most once), so nothing is dropped.
"""

from __future__ import annotations

import enum
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["RouterSoftmax", "Routing", "expert_capacity", "route", "route_tokens"]


class RouterSoftmax(enum.Enum):
    """Where the router's softmax sits relative to the top-k choice (``softmax=``).

    * ``BEFORE_TOP_K`` (``"before_top_k"``, the default): the softmax over all experts,
      then the k largest probabilities weigh the chosen experts' outputs (Switch,
      DeepSeek, Qwen-MoE without ``norm_topk_prob``).
    * ``AFTER_TOP_K`` (``"after_top_k"``): the k largest logits, then a softmax over
      those k (Mixtral; the weights of a token sum to 1).

    The load-balancing loss reads the softmax over all experts either way.

    Example:

    >>> RouterSoftmax("after_top_k")
    <RouterSoftmax.AFTER_TOP_K: 'after_top_k'>
    """

    BEFORE_TOP_K = "before_top_k"
    AFTER_TOP_K = "after_top_k"


class Routing(NamedTuple):
    """One forward pass's routing, per row.

    Attributes:
      dispatch: ``[rows, tokens, experts, capacity]``, 1 where a token takes a slot.
      combine: the same shape, the router weight of each kept slot.
      dropped: ``[rows]``, the assignments (token, rank) each row dropped.
      load_balance: ``[rows]``, each row's load-balancing loss (unweighted).
      z_loss: ``[rows]``, each row's router z-loss (unweighted).
    """

    dispatch: jax.Array
    combine: jax.Array
    dropped: jax.Array
    load_balance: jax.Array
    z_loss: jax.Array


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: Any) -> int:
    """The slots each expert has for one row of `tokens` tokens (module docstring).

    With `capacity_factor` None (dropless): `tokens`, room for every token of the row.

    Example:

    >>> expert_capacity(8, 4, 2, 1.0), expert_capacity(8, 4, 2, 1.5), expert_capacity(8, 4, 2, None)
    (4, 6, 8)
    """
    if capacity_factor is None:
        return tokens
    per_expert = math.ceil(tokens * top_k / num_experts)
    return max(int(max(per_expert * capacity_factor, capacity_factor)), 1)


def route(
    logits: jax.Array,
    *,
    top_k: int,
    capacity_factor: Any,
    softmax: RouterSoftmax = RouterSoftmax.BEFORE_TOP_K,
) -> Routing:
    """Routes each row's tokens to their top-k experts (`logits`: ``[rows, tokens, E]``).

    Example:

    >>> import jax.numpy as jnp
    >>> logits = jnp.array([[[2.0, 0.0], [3.0, 0.0], [0.0, 1.0]]])  # 1 row, 3 tokens
    >>> r = route(logits, top_k=1, capacity_factor=1.0)  # 2 slots an expert
    >>> r.dispatch.shape, r.dropped.tolist()  # tokens 0 and 1 both fit in expert 0
    ((1, 3, 2, 2), [0.0])
    >>> route(logits, top_k=1, capacity_factor=0.5).dropped.tolist()  # 1 slot: token 1 out
    [1.0]
    """
    rows, tokens, num_experts = logits.shape
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if softmax is RouterSoftmax.AFTER_TOP_K:
        top_logits, chosen = jax.lax.top_k(logits, top_k)
        weights = jax.nn.softmax(top_logits, axis=-1)
    else:
        weights, chosen = jax.lax.top_k(probs, top_k)
    capacity = expert_capacity(tokens, num_experts, top_k, capacity_factor)
    picks = jax.nn.one_hot(chosen, num_experts, dtype=jnp.int32)  # [rows, tokens, k, E]
    # Each expert's slot for an assignment: its count so far in token-major, rank-minor order.
    fused = picks.reshape(rows, tokens * top_k, num_experts)
    position = jnp.cumsum(fused, axis=1).reshape(picks.shape)  # 1-based where picked
    kept = picks * (position <= capacity)
    slot = jax.nn.one_hot(position - 1, capacity, dtype=jnp.float32)  # -1 (unpicked): zeros
    slots = kept[..., None].astype(jnp.float32) * slot  # [rows, tokens, k, E, C]
    dispatch = jnp.sum(slots, axis=2)
    combine = jnp.sum(slots * weights[..., None, None], axis=2)
    dropped = (tokens * top_k - jnp.sum(kept, axis=(1, 2, 3))).astype(jnp.float32)
    fraction = jnp.mean(jnp.sum(picks, axis=2).astype(jnp.float32), axis=1)  # [rows, E]
    load_balance = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=1), axis=-1)
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), axis=1)
    return Routing(dispatch, combine, dropped, load_balance, z_loss)


def route_tokens(tokens: jax.Array, router: jax.Array, settings: dict[str, Any]) -> Routing:
    """`route` of `tokens` ``(rows, tokens, d)`` through the ``(d, experts)`` `router`
    weights, with the layer's `settings` (``top_k``, ``capacity_factor``, ``softmax``): the
    one routing the dense and the expert-parallel paths share."""
    logits = jnp.einsum("btd,de->bte", tokens, router)
    return route(
        logits,
        top_k=settings["top_k"],
        capacity_factor=settings["capacity_factor"],
        softmax=settings["softmax"],
    )
