"""`NNXMoE`: the mixture-of-experts layer for Flax NNX (the linen `MoE`'s computation)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jstrategy._src.moe import losses
from jstrategy._src.moe.axis import EXPERT_AXIS
from jstrategy._src.moe.config import check_settings
from jstrategy._src.moe.experts import moe_forward
from jstrategy._src.moe.linen import expert_init
from jstrategy._src.moe.linen import router_init
from jstrategy._src.moe.routing import Routing

__all__ = ["NNXMoE"]


class NNXMoE(nnx.Module):
    """A mixture of SwiGLU experts for NNX: `jstrategy.experimental.MoE`'s arguments and
    computation, with ``in_features`` given and ``rngs`` for the weights.

    In a train or evaluation step of `create_nnx_train_state`'s state (`Model.fit`,
    `make_train_step`), the weighted load-balancing and z-losses are added to the loss;
    called directly, the layer adds nothing. `routing` returns the routing itself (drop
    counts, per-row losses).

    Example:

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = NNXMoE(5, num_experts=4, top_k=2, hidden_dim=8, rngs=nnx.Rngs(0))
    >>> layer.wi_0.shape, layer(jnp.ones((2, 3, 5))).shape
    ((4, 5, 8), (2, 3, 5))
    """

    def __init__(
        self,
        in_features: int,
        *,
        num_experts: int = 8,
        top_k: int = 2,
        hidden_dim: int = 64,
        capacity_factor: float | None = None,
        softmax: Any = "before_top_k",
        load_balance_weight: float = 0.01,
        z_loss_weight: float = 0.001,
        rngs: nnx.Rngs,
    ) -> None:
        self.settings = check_settings(
            num_experts=num_experts,
            top_k=top_k,
            hidden_dim=hidden_dim,
            capacity_factor=capacity_factor,
            softmax=softmax,
            load_balance_weight=load_balance_weight,
            z_loss_weight=z_loss_weight,
        )
        e, f = self.settings["num_experts"], self.settings["hidden_dim"]

        def param(init: Any, shape: tuple[int, ...], **metadata: Any) -> nnx.Param:
            return nnx.Param(init(rngs.params(), shape, jnp.float32), **metadata)

        self.router = param(router_init, (in_features, e))
        # The experts' axis is the expert axis's, where a strategy has one (`axis`). NNX
        # keeps a name no rule maps as a mesh axis: under `ModelParallelStrategy`, whose
        # mesh lacks it, pass logical_axis_rules=[("expert", None)] (or a LayoutMap entry).
        # Not placed now (no mesh need exist): the strategy places it from the annotation.
        experts = {"out_sharding": (EXPERT_AXIS, None, None), "eager_sharding": False}
        self.wi_0 = param(expert_init, (e, in_features, f), **experts)
        self.wi_1 = param(expert_init, (e, in_features, f), **experts)
        self.wo = param(expert_init, (e, f, in_features), **experts)

    def routing(self, x: jax.Array) -> Routing:
        """The routing of `x` (``dropped`` per row, the unweighted per-row losses)."""
        return self._forward(x)[1]

    def _forward(self, x: jax.Array) -> tuple[jax.Array, Routing]:
        weights = (self.router[...], self.wi_0[...], self.wi_1[...], self.wo[...])
        return moe_forward(jnp.asarray(x), *weights, self.settings)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, routing = self._forward(x)
        for value in losses.aux_loss(routing, self.settings).values():
            losses.add_loss(value)
        return y
