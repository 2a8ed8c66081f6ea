"""The expert layers' auxiliary losses and drop counts: how they reach the training loss.

Each row's load-balancing loss and router z-loss (`routing`) are averaged over the real
rows the forward pass holds (the step's row mask: a padded partial batch's padding rows
count for nothing), times their weights. The train step adds a model's losses once per
real row and divides by the global count of real rows, so across replicas the added term
is the mean over the global batch's real rows, as one device computes it.

* linen: sown into ``"losses"`` (`jstrategy.regularizers.LOSSES`), as the weight
  regularizers are: `Model.fit`, `make_train_step` and the evaluation step add them.
* NNX: a module cannot sow without changing its state's structure, so the layer hands
  them to `collecting`, which `NNXTrainState`'s forward pass enters (`add_loss`).

Drop counts go to the ``"intermediates"`` collection (linen, when it is mutable):
``dropped`` (assignments dropped) and ``assigned`` (assignments made, ``tokens *
top_k`` a row), summed over the real rows; `dropped_fraction` reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jstrategy._src import batch_region
from jstrategy._src.layers.regularizers import LOSSES
from jstrategy._src.moe.routing import Routing

__all__ = ["INTERMEDIATES", "add_loss", "collecting", "dropped_fraction", "row_weights", "sow"]

#: The collection the linen layer sows its drop counts into.
INTERMEDIATES = "intermediates"

# The losses NNX layers add during a forward pass that collects them (a context variable:
# each thread, and each trace, sees its own list).
_COLLECTED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "jstrategy_moe_losses", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[list[Any]]:
    """Within: `add_loss` appends to the list yielded (NNX forward passes)."""
    sown: list[Any] = []
    token = _COLLECTED.set(sown)
    try:
        yield sown
    finally:
        _COLLECTED.reset(token)


def add_loss(value: Any) -> None:
    """Adds `value` to the loss of the NNX forward pass being traced, if it collects any."""
    sown = _COLLECTED.get()
    if sown is not None:
        sown.append(value)


def row_weights(rows: int) -> jax.Array:
    """``(rows,)``: 1 for each real row of the forward pass (the step's row mask), else 0."""
    region = batch_region.current()
    mask = None if region is None else region.row_mask
    if mask is None or np.shape(mask) != (rows,):
        return jnp.ones((rows,), jnp.float32)
    return jnp.asarray(mask, jnp.float32)


def _mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)  # no real rows: 0


def aux_loss(routing: Routing, settings: dict[str, Any]) -> dict[str, jax.Array]:
    """The weighted auxiliary losses, each the mean over the real rows (by name)."""
    weights = row_weights(routing.load_balance.shape[0])
    out = {}
    if settings["load_balance_weight"]:
        out["load_balance_loss"] = settings["load_balance_weight"] * _mean(
            routing.load_balance, weights
        )
    if settings["z_loss_weight"]:
        out["router_z_loss"] = settings["z_loss_weight"] * _mean(routing.z_loss, weights)
    return out


def counts(routing: Routing, top_k: int) -> dict[str, jax.Array]:
    """``dropped`` and ``assigned``, summed over the real rows."""
    weights = row_weights(routing.dropped.shape[0])
    per_row = routing.dispatch.shape[1] * top_k
    return {
        "dropped": jnp.sum(routing.dropped * weights),
        "assigned": jnp.sum(weights) * per_row,
    }


def sow(module: Any, routing: Routing, settings: dict[str, Any]) -> None:
    """A linen layer's losses into ``"losses"`` and counts into ``"intermediates"``, each
    where the collection is mutable (never while initializing)."""
    if module.is_initializing():
        return
    if module.is_mutable_collection(LOSSES):
        for name, value in aux_loss(routing, settings).items():
            module.sow(LOSSES, name, value)
    if module.is_mutable_collection(INTERMEDIATES):
        for name, value in counts(routing, settings["top_k"]).items():
            module.sow(INTERMEDIATES, name, value)


def dropped_fraction(intermediates: Any) -> float:
    """The fraction of assignments dropped, from a linen apply's ``"intermediates"``.

    Sums the ``dropped`` and ``assigned`` counts of every expert layer in the tree.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from jstrategy.experimental import MoE
    >>> layer = MoE(num_experts=4, top_k=2, hidden_dim=8, capacity_factor=0.5)
    >>> x = jax.random.normal(jax.random.key(0), (2, 16, 4))
    >>> variables = layer.init(jax.random.key(1), x)
    >>> _, state = layer.apply(variables, x, mutable=["intermediates"])
    >>> 0 < dropped_fraction(state["intermediates"]) < 1
    True
    """
    dropped = assigned = 0.0

    def visit(tree: Any) -> None:
        nonlocal dropped, assigned
        if isinstance(tree, Mapping):
            if "dropped" in tree and "assigned" in tree:
                dropped += float(sum(np.sum(v) for v in jax.tree.leaves(tree["dropped"])))
                assigned += float(sum(np.sum(v) for v in jax.tree.leaves(tree["assigned"])))
            for key, value in tree.items():
                if key not in ("dropped", "assigned"):
                    visit(value)

    visit(jax.device_get(intermediates))
    return dropped / assigned if assigned else 0.0
