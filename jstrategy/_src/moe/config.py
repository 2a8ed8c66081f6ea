"""The settings an expert layer is built with, checked once for the linen and NNX layers."""

from __future__ import annotations

import contextlib
from typing import Any

from jstrategy._src.moe.routing import RouterSoftmax
from jstrategy._src.validation import check_number

__all__ = ["check_settings"]


def _softmax(value: Any) -> RouterSoftmax:
    if isinstance(value, RouterSoftmax):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return RouterSoftmax(value)
    raise ValueError(
        f"`softmax` must be one of {[m.value for m in RouterSoftmax]} or a "
        f"jstrategy.experimental.RouterSoftmax; got {value!r}. 'before_top_k' weighs the "
        "chosen experts by their probability among all experts (Switch, DeepSeek), "
        "'after_top_k' by a softmax over the chosen ones (Mixtral)."
    )


def check_settings(
    *,
    num_experts: Any,
    top_k: Any,
    hidden_dim: Any,
    capacity_factor: Any,
    softmax: Any,
    load_balance_weight: Any,
    z_loss_weight: Any,
) -> dict[str, Any]:
    """The settings, normalized (ints, floats, the `RouterSoftmax`), or a `ValueError` that
    names the argument, what was expected, what was given and the fix.

    Example:

    >>> check_settings(num_experts=4, top_k=5, hidden_dim=8, capacity_factor=None,
    ...                softmax="before_top_k", load_balance_weight=0.01, z_loss_weight=0.0)
    Traceback (most recent call last):
    ...
    ValueError: `top_k` must be at most `num_experts` (4): each token picks distinct experts; got 5. Pass top_k <= 4, or more experts.
    """
    num_experts = check_number(
        num_experts, "num_experts", integer=True, low=1, fix="E.g. num_experts=8."
    )
    top_k = check_number(top_k, "top_k", integer=True, low=1, fix="E.g. top_k=2.")
    if top_k > num_experts:
        raise ValueError(
            f"`top_k` must be at most `num_experts` ({num_experts}): each token picks "
            f"distinct experts; got {top_k}. Pass top_k <= {num_experts}, or more experts."
        )
    hidden_dim = check_number(
        hidden_dim, "hidden_dim", integer=True, low=1, fix="E.g. hidden_dim=4 * features."
    )
    if capacity_factor is not None:
        capacity_factor = float(
            check_number(
                capacity_factor,
                "capacity_factor",
                low=0,
                low_open=True,
                finite=True,
                expected="a positive number (each expert's slots per row, relative to an "
                "even share) or None (dropless)",
                fix="E.g. capacity_factor=1.25, or None to drop no token.",
            )
        )
    weights = {}
    for name, value in (
        ("load_balance_weight", load_balance_weight),
        ("z_loss_weight", z_loss_weight),
    ):
        weights[name] = float(
            check_number(value, name, low=0, finite=True, fix=f"E.g. {name}=0.01, or 0 for none.")
        )
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "hidden_dim": hidden_dim,
        "capacity_factor": capacity_factor,
        "softmax": _softmax(softmax),
        **weights,
    }
