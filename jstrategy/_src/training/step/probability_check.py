"""The warning for a probability loss given logits: counted in the step, read once, not waited for.

``loss="sparse_categorical_crossentropy"`` means probabilities, as in Keras (Keras's
default ``from_logits=False``). A model that ends in a dense layer gives logits, and the
loss then clips and renormalizes them: it still trains, but badly (sklearn's digits, an
MLP 64-64-10, Adam, 10 epochs: 0.11 training accuracy, 0.96 with ``from_logits=True``),
and Keras says nothing. Every step of a loss that expects probabilities (`Loss.expects_probabilities`)
therefore also counts, with its loss sums, the real rows whose predictions are not
probabilities: a value outside [0, 1], or (categorical) a row not summing to 1. The host
reads the first step's count once it is ready, without waiting for it (`Watch` polls
``is_ready``; the end of an epoch waits anyway), and warns once per model or step
function (`NotProbabilitiesWarning`), naming ``from_logits=True``.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.training.step.spec import NOT_PROBABILITIES_KEY
from jstrategy._src.training.step.spec import StepSpec

__all__ = ["KEY", "NotProbabilitiesWarning", "count", "keys", "warn"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The key of the count in a step's sums (a fraction of the real rows in its logs).
KEY = NOT_PROBABILITIES_KEY

# Softmax rows sum to 1 within float32 rounding; bfloat16 outputs within ~1e-2. A row of
# logits almost never sums to 1 within that, or stays inside [0, 1].
_RANGE_TOLERANCE = 1e-3
_SUM_TOLERANCE = 2e-2


class NotProbabilitiesWarning(UserWarning):
    """A loss that expects probabilities got predictions that are not probabilities.

    Given once per `jstrategy.Model` (or per step made by `make_train_step` /
    `make_eval_step`), for the first step, when some real row of the predictions has a
    value outside [0, 1] or (for categorical losses) does not sum to 1. Usually the model
    outputs logits: pass the loss with ``from_logits=True``; or end the model with a
    softmax (sigmoid for binary cross-entropy).

    Example:

    >>> issubclass(NotProbabilitiesWarning, UserWarning)
    True
    """


def _kind(spec: StepSpec) -> str | None:
    return spec.expects_probabilities


def keys(spec: StepSpec) -> tuple[str, ...]:
    """``(KEY,)`` when the step's loss expects probabilities, else ``()``."""
    return (KEY,) if _kind(spec) else ()


def count(spec: StepSpec, y_pred: Any, maskf: jax.Array) -> dict[str, jax.Array]:
    """One replica's count of real rows whose predictions are not probabilities, under
    `KEY` (traced in the step; summed over replicas with the loss sums). Empty when the
    loss does not expect probabilities."""
    kind = _kind(spec)
    if kind is None:
        return {}
    zero = jnp.sum(maskf) * 0.0  # per replica, like the sums it joins
    if not isinstance(y_pred, jax.Array) or y_pred.ndim == 0:
        return {KEY: zero}
    p = y_pred.astype(jnp.float32).reshape(maskf.shape[0], -1, y_pred.shape[-1])
    bad = (p < -_RANGE_TOLERANCE) | (p > 1.0 + _RANGE_TOLERANCE)
    rows = bad.any(axis=(1, 2))
    if kind == "categorical":
        rows = rows | (jnp.abs(jnp.sum(p, axis=-1) - 1.0) > _SUM_TOLERANCE).any(axis=1)
    return {KEY: zero + jnp.sum(rows * maskf)}


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first caller outside jstrategy (`fit`, a
    train step's call...), whose depth differs by route."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def warn(spec: StepSpec, fraction: float, where: str) -> None:
    """Warns that `fraction` of the real rows at `where` were not probabilities."""
    loss = spec.loss
    name = type(loss).__name__
    expected = (
        "probabilities (values in [0, 1])"
        if _kind(spec) == "binary"
        else "rows of probabilities (values in [0, 1] summing to 1)"
    )
    warnings.warn(
        f"The loss {getattr(loss, 'name', name)!r} ({name} with from_logits=False, as "
        f"Keras's default) expects {expected}, but {fraction:.0%} of the real rows of the "
        f"model's predictions at {where} are not: the model seems to output logits, on "
        f"which this loss trains badly. Pass loss=jstrategy.losses.{name}(from_logits=True) "
        "(as in Keras), or end the model with a softmax (sigmoid for binary "
        "cross-entropy). This warning is given once.",
        NotProbabilitiesWarning,
        stacklevel=_user_stacklevel(),
    )
