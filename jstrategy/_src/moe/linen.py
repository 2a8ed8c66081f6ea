"""`MoE`: a mixture-of-experts feed-forward layer, linen and Keras style at once."""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from jstrategy._src.layers.base import Layer
from jstrategy._src.moe import losses
from jstrategy._src.moe.axis import EXPERT_AXIS
from jstrategy._src.moe.axis import EXPERT_HIDDEN
from jstrategy._src.moe.config import check_settings
from jstrategy._src.moe.experts import moe_forward

__all__ = ["MoE", "expert_init", "router_init"]

#: The router's initializer: LeCun normal over the features.
router_init = nn.initializers.lecun_normal()
#: The stacked experts' initializer: LeCun normal within each expert (axis 0 the experts).
expert_init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(Layer):
    """A mixture of SwiGLU experts: each token goes to its `top_k` experts by a router.

    Returns the experts' outputs, shaped like the input (``(rows, ..., features)``; the
    middle axes are a row's tokens). Each row is routed on its own (its tokens share the
    experts' capacity), so the outputs, drops and losses of a row do not depend on how the
    batch is split over replicas: every data-parallel strategy follows one device.

    In a train or evaluation step the load-balancing loss and the router z-loss, each the
    mean over the real rows times its weight, are added to the loss (as Keras adds
    ``model.losses``); the drop counts go to ``"intermediates"`` when it is mutable
    (`jstrategy.experimental.moe_dropped_fraction` reads them). Definitions: the
    `jstrategy._src.moe.routing` module docstring (MaxText's, with a row as the group).

    Args:
      num_experts: the experts (E).
      top_k: the experts each token goes to (MaxText's ``num_experts_per_tok``), at most E.
      hidden_dim: each expert's hidden size (MaxText's ``mlp_dim``).
      capacity_factor: each expert's slots for a row, relative to an even share:
        ``max(ceil(tokens * top_k / E) * capacity_factor, capacity_factor)``; assignments
        beyond it are dropped (the token keeps its other experts' outputs). None
        (the default): dropless.
      softmax: a `RouterSoftmax` or its value: ``"before_top_k"`` (default) or
        ``"after_top_k"``.
      load_balance_weight: the load-balancing loss's weight (default 0.01); 0 adds
        none. MaxText's ``load_balance_loss_weight=w`` is ``w / (top_k * layers)`` here
        (`jstrategy._src.moe.routing`).
      z_loss_weight: the router z-loss's weight (default 0.001, ST-MoE's); 0 adds none.
      input_shape: the shape of one input row, for the first layer of a `Sequential`.

    Example:

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> layer = MoE(num_experts=4, top_k=2, hidden_dim=8)
    >>> x = jnp.ones((2, 3, 5))                       # 2 rows of 3 tokens, 5 features
    >>> variables = layer.init(jax.random.key(0), x)
    >>> params = nn.unbox(variables["params"])  # the experts' axis is annotated "expert"
    >>> jax.tree.map(jnp.shape, params)
    {'router': (5, 4), 'wi_0': (4, 5, 8), 'wi_1': (4, 5, 8), 'wo': (4, 8, 5)}
    >>> layer.apply(variables, x).shape
    (2, 3, 5)
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 64
    capacity_factor: float | None = None
    softmax: Any = "before_top_k"
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.001
    input_shape: Any = None

    has_weights: ClassVar[bool] = True

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        settings = _settings(self)
        for name in ("capacity_factor", "softmax", "load_balance_weight", "z_loss_weight"):
            object.__setattr__(self, name, settings[name])

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        del training  # routing is the same in training and inference
        inputs = self.cast_inputs(jnp.asarray(inputs))
        features = inputs.shape[-1]
        experts, hidden = self.num_experts, self.hidden_dim
        router = self.param("router", router_init, (features, experts), jnp.float32)
        # The experts' axis, by its logical name: a strategy with an expert axis maps it
        # there (`FSDPStrategy(experts=k)`'s rule); for any other the name maps to
        # nothing and the weights are laid as the strategy lays any variable.
        # Their hidden units likewise (`EXPERT_HIDDEN`: a tensor axis, under
        # `ParallelStrategy`).
        init_in: Any = nn.with_logical_partitioning(expert_init, (EXPERT_AXIS, None, EXPERT_HIDDEN))
        init_out: Any = nn.with_logical_partitioning(
            expert_init, (EXPERT_AXIS, EXPERT_HIDDEN, None)
        )
        wi_0 = self.param("wi_0", init_in, (experts, features, hidden), jnp.float32)
        wi_1 = self.param("wi_1", init_in, (experts, features, hidden), jnp.float32)
        wo = self.param("wo", init_out, (experts, hidden, features), jnp.float32)
        if self.dtype is not None:
            dtype = self.compute_dtype(inputs, wi_0)
            router, wi_0, wi_1, wo = (w.astype(dtype) for w in (router, wi_0, wi_1, wo))
        y, routing = moe_forward(inputs, router, wi_0, wi_1, wo, _settings(self))
        losses.sow(self, routing, _settings(self))
        return y


def _settings(layer: Any) -> dict[str, Any]:
    return check_settings(
        num_experts=layer.num_experts,
        top_k=layer.top_k,
        hidden_dim=layer.hidden_dim,
        capacity_factor=layer.capacity_factor,
        softmax=layer.softmax,
        load_balance_weight=layer.load_balance_weight,
        z_loss_weight=layer.z_loss_weight,
    )
