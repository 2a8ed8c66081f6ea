"""The experts' computation, shared by the linen and NNX layers: route, dispatch, SwiGLU, combine.

Tokens reach their experts by the dense dispatch of MaxText's CPU path (an einsum with the
``[rows, tokens, experts, capacity]`` dispatch mask) and come back weighted by the combine
mask. The expert weights are stacked on a leading ``experts`` axis:
``wi_0, wi_1: [experts, features, hidden]``, ``wo: [experts, hidden, features]``; each
expert is a SwiGLU MLP, ``(silu(x @ wi_0) * (x @ wi_1)) @ wo``. Under a mesh with an
expert axis the experts are split over it (`parallel.expert_parallel`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.moe.axis import expert_degree
from jstrategy._src.moe.parallel import dense_experts
from jstrategy._src.moe.parallel import expert_parallel
from jstrategy._src.moe.routing import Routing
from jstrategy._src.moe.routing import route_tokens

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
    tokens = tokens.astype(dtype)
    router, wi_0, wi_1, wo = (w.astype(dtype) for w in (router, wi_0, wi_1, wo))
    degree = expert_degree()
    if degree > 1:
        y, routing = expert_parallel(tokens, router, (wi_0, wi_1, wo), settings, degree)
        return y.reshape(shape), routing
    routing = route_tokens(tokens, router, settings)
    return dense_experts(tokens, routing, wi_0, wi_1, wo).reshape(shape), routing
