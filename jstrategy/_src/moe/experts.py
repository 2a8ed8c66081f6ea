"""The experts' computation, shared by the linen and NNX layers: route, dispatch, SwiGLU, combine.

Tokens reach their experts by the dense dispatch of MaxText's CPU path (an einsum with the
``[rows, tokens, experts, capacity]`` dispatch mask) and come back weighted by the combine
mask. The expert weights are stacked on a leading ``experts`` axis:
``wi_0, wi_1: [experts, features, hidden]``, ``wo: [experts, hidden, features]``; each
expert is a SwiGLU MLP, ``(silu(x @ wi_0) * (x @ wi_1)) @ wo``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.moe.routing import Routing
from jstrategy._src.moe.routing import route

__all__ = ["as_tokens", "moe_forward"]


def as_tokens(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    """`x` as ``[rows, tokens, features]`` (a row's middle axes flattened; a
    ``[rows, features]`` input is one token a row), and the shape to restore."""
    if x.ndim < 2:
        raise ValueError(
            f"An expert layer takes inputs of shape (rows, ..., features); got shape "
            f"{tuple(x.shape)}. Add a batch axis (x[None])."
        )
    shape = tuple(x.shape)
    return x.reshape(shape[0], -1, shape[-1]), shape


def moe_forward(
    x: jax.Array,
    router: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    settings: dict[str, Any],
) -> tuple[jax.Array, Routing]:
    """``(output shaped like x, the routing)`` of the experts on `x`."""
    tokens, shape = as_tokens(x)
    dtype = jnp.result_type(tokens, wi_0)
    logits = jnp.einsum("btd,de->bte", tokens, router.astype(dtype))
    routing = route(
        logits,
        top_k=settings["top_k"],
        capacity_factor=settings["capacity_factor"],
        softmax=settings["softmax"],
    )
    slots = jnp.einsum("btd,btec->ebcd", tokens, routing.dispatch.astype(dtype))
    gate = jnp.einsum("ebcd,edf->ebcf", slots, wi_0.astype(dtype))
    up = jnp.einsum("ebcd,edf->ebcf", slots, wi_1.astype(dtype))
    out = jnp.einsum("ebcf,efd->ebcd", jax.nn.silu(gate) * up, wo.astype(dtype))
    y = jnp.einsum("ebcd,btec->btd", out, routing.combine.astype(dtype))
    return y.reshape(shape), routing
