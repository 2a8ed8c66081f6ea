"""The opt-in numerics check inside the step, as TF's ``tf.debugging.enable_check_numerics``.

With `enable_check_numerics`, the train and eval steps compiled afterwards (`Model.compile`,
`make_train_step`, `make_eval_step`) also count, on each replica and with the loss sums'
one all-reduce, the real rows whose class labels fall outside ``[0, num_classes)`` of the
predictions (for sparse categorical losses and metrics) and whether the loss sum and the
gradients are finite. The host reads these counts when the step's outputs are ready,
without waiting for them (`Watch`), and at the points where it waits anyway (the end of an
epoch or an evaluation), then raises an error that names the first step where it went
wrong. Steps compiled without the check are the same programs as before, bit for bit.

Under dynamic loss scaling (a float16 compute dtype) every train step also counts, check
or not, whether it was skipped with the loss scale at its floor (`FLOOR`): overflowing
gradients are how the scale is found above the floor, but at the floor a skipped step is
one that can never train. The count joins the step's sums; `fit` reads it with the epoch's
logs, at the epoch's one host synchronization, and warns once (`warn_loss_scale_floor`);
with the check on, the step that did it raises.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jstrategy._src.precision.loss_scale import DynamicLossScale
from jstrategy._src.precision.loss_scale import LossScaleFloorWarning
from jstrategy._src.precision.loss_scale import all_finite
from jstrategy._src.training.input_checks import class_label_functions
from jstrategy._src.training.state import train_state
from jstrategy._src.training.step import probability_check
from jstrategy._src.training.step.spec import CHECKED_KEYS
from jstrategy._src.training.step.spec import FLOOR_KEY
from jstrategy._src.training.step.spec import StepSpec

__all__ = [
    "FLOOR",
    "KEYS",
    "Watch",
    "check_numerics_enabled",
    "disable_check_numerics",
    "enable_check_numerics",
    "loss_scale_flags",
    "step_flags",
    "sum_keys",
    "warn_loss_scale_floor",
]

LABELS, LOSS, GRADIENTS = CHECKED_KEYS
#: The keys the check adds to a step's sums (and logs); `Model`'s logs leave them out.
KEYS = CHECKED_KEYS
#: Steps skipped with the loss scale at its floor: in every loss-scaled step's sums.
FLOOR = FLOOR_KEY
_FLOOR_FIX = (
    "Train with dtype_policy='mixed_bfloat16' (bfloat16 has float32's range and needs no "
    "loss scale), or with a loss whose gradients do not overflow float16 (inputs and "
    "targets of moderate size, e.g. standardized)."
)

_ENABLED = False


def enable_check_numerics() -> None:
    """Checks labels, the loss and the gradients in every step compiled from now on.

    The analogue of ``tf.debugging.enable_check_numerics``, for jstrategy's steps: a train
    or eval step made afterwards (by `jstrategy.Model.compile`, `make_train_step` or
    `make_eval_step`) raises, naming the step, when a real row's class label is outside
    ``[0, num_classes)`` (sparse categorical losses and metrics: ``ValueError``) or the
    loss or the gradients are NaN or infinite (``FloatingPointError``). The check adds a
    few reductions to each step and no host synchronization: the error comes a few steps
    after the faulty one, at the latest when the epoch (or evaluation) ends. Compile
    again to turn it on for a model compiled before.

    Example:

    >>> import numpy as np, flax.linen as nn, jstrategy
    >>> jstrategy.config.enable_check_numerics()
    >>> model = jstrategy.Model(nn.Dense(3), input_shape=(2,))
    >>> loss = jstrategy.losses.SparseCategoricalCrossentropy(from_logits=True)
    >>> model.compile("sgd", loss=loss)
    >>> jstrategy.config.disable_check_numerics()
    >>> x, y = np.ones((4, 2), np.float32), np.array([0, 1, 2, 1])
    >>> x[2, 0] = np.nan
    >>> model.fit(x, y, verbose=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FloatingPointError: Check numerics: the loss is NaN or infinite at training step 0 of epoch 0...
    """
    global _ENABLED
    _ENABLED = True


def disable_check_numerics() -> None:
    """Steps compiled from now on skip the check (the default).

    Example:

    >>> import jstrategy
    >>> jstrategy.config.enable_check_numerics()
    >>> jstrategy.config.disable_check_numerics()
    >>> jstrategy.config.check_numerics_enabled()
    False
    """
    global _ENABLED
    _ENABLED = False


def check_numerics_enabled() -> bool:
    """Whether steps compiled now include the numerics check.

    Example:

    >>> import jstrategy
    >>> jstrategy.config.enable_check_numerics()
    >>> jstrategy.config.check_numerics_enabled()
    True
    >>> jstrategy.config.disable_check_numerics()
    >>> jstrategy.config.check_numerics_enabled()
    False
    """
    return _ENABLED


def _loss_scaled(spec: StepSpec) -> bool:
    return train_state.uses_loss_scale(spec.policy)


def sum_keys(spec: StepSpec) -> tuple[str, ...]:
    """The keys a step of `spec` adds to its sums besides the loss, metrics and count."""
    return spec.extra_sum_keys()


def loss_scale_flags(
    spec: StepSpec, loss_scale: DynamicLossScale | None = None, grads: Any = None
) -> dict[str, jax.Array]:
    """1.0 under `FLOOR` when this step is skipped at the loss scale's floor, else 0.0.

    Traced in the step after the gradients were combined and unscaled, on whole values
    (identical on every replica in a manual region, global in the global view), so no
    collective is needed. Evaluation (no `loss_scale`) adds a 0, so that train and eval
    sums have the same keys. Empty when `spec` has no loss scaling.
    """
    if not _loss_scaled(spec):
        return {}
    if loss_scale is None:
        return {FLOOR: jnp.float32(0)}
    return {FLOOR: loss_scale.skipped_at_floor(all_finite(grads)).astype(jnp.float32)}


def warn_loss_scale_floor(
    skipped: Any, steps: int, epoch: int, loss_scale: DynamicLossScale | None
) -> bool:
    """Warns (`LossScaleFloorWarning`) when `skipped` of an epoch's `steps` were skipped
    at the loss scale's floor; returns whether it warned. `skipped` is the host value of
    the epoch's `FLOOR` sum (None: the step has no loss scale)."""
    count = 0 if skipped is None else round(float(skipped))
    if not count or loss_scale is None:
        return False
    warnings.warn(
        f"Dynamic loss scaling is stuck: {count} of the {steps} training steps of epoch "
        f"{epoch} were skipped (the weights did not move) with the loss scale at its floor "
        f"(min_loss_scale={float(loss_scale.min_loss_scale)}): the float16 gradients "
        f"overflow even unscaled, so these steps never train, whatever the logged loss "
        f"says. {_FLOOR_FIX} This warning is given once per fit; "
        "jstrategy.config.enable_check_numerics() makes it an error at the first such step.",
        LossScaleFloorWarning,
        stacklevel=6,  # warn_loss_scale_floor < FitEpoch.run < run_fit_epoch < fit < Model.fit
    )
    return True


def step_flags(
    spec: StepSpec, y: Any, y_pred: Any, maskf: jax.Array, loss_sum: Any, grads: Any = None
) -> dict[str, jax.Array]:
    """One replica's counts, traced in the step: rows with labels out of range, and 1.0 for
    a non-finite loss sum or gradient. They are summed over replicas with the loss sums."""
    zero = jnp.sum(maskf) * 0.0  # per replica, like the sums it joins
    labels = zero
    if (
        class_label_functions(spec.functions)
        and isinstance(y, jax.Array)
        and isinstance(y_pred, jax.Array)
    ):
        classes = y_pred.shape[-1] if y_pred.ndim >= 2 else None
        if y.ndim == y_pred.ndim and y.shape[-1] == 1:
            y = jnp.squeeze(y, -1)
        if classes is not None and y.shape == y_pred.shape[:-1]:
            index = y.astype(jnp.int32)
            bad = ((index < 0) | (index >= classes)).reshape(index.shape[0], -1).any(axis=1)
            labels = jnp.sum(bad * maskf)
    loss = zero if loss_sum is None else zero + (~jnp.isfinite(loss_sum)).astype(jnp.float32)
    finite = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
    gradients = zero
    if finite:
        gradients = zero + (~jnp.all(jnp.stack(finite))).astype(jnp.float32)
    return {LABELS: labels, LOSS: loss, GRADIENTS: gradients}


class Watch:
    """The host's side of the check: reads each step's counts once they are ready.

    `add` records a step's logs and checks those of earlier steps that have finished (a
    test, not a wait); `finish` checks the rest, where the loop waits anyway. A disabled
    watch (the step was compiled without the check) checks only the first step's
    predictions against a loss that expects probabilities (`probability_check`), once per
    `probed` set.

    Args:
      spec: the compiled step.
      what: how a step is named in the error, e.g. ``"training step"``.
      context: appended to the step's name, e.g. ``" of epoch 3"``.
      probed: the watches sharing this set check the predictions of the first step any
        of them sees, and only that one (a model's epochs and evaluations share one).
    """

    def __init__(
        self, spec: StepSpec, what: str, context: str = "", probed: set[str] | None = None
    ):
        self.enabled = spec.check_numerics
        self._spec = spec
        self._keys = sum_keys(spec)
        self._what = what
        self._context = context
        self._pending: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque()
        self._probed = set() if probed is None else probed
        self._probe: tuple[str, Any] | None = None

    def add(self, logs: dict[str, Any], first: int, last: int | None = None) -> dict[str, Any]:
        """Records the logs of steps `first` to `last`; returns them without the counts.

        Raises:
          ValueError, FloatingPointError: for an earlier step that went wrong.
        """
        if not self._keys:
            return logs
        last = first if last is None else last
        key = probability_check.KEY
        if key in logs and key not in self._probed:
            self._probed.add(key)
            self._probe = (self._where(first, last), logs[key])
        self._read_probe(wait=False)
        if self.enabled:
            flags = {k: logs[k] for k in self._keys if k in logs}
            self._pending.append((first, last, flags))
            while self._pending and all(v.is_ready() for v in self._pending[0][2].values()):
                self._check(*self._pending.popleft())
        return {k: v for k, v in logs.items() if k not in self._keys}

    def finish(self) -> None:
        """Checks every step recorded (waiting for them)."""
        self._read_probe(wait=True)
        while self._pending:
            self._check(*self._pending.popleft())

    def _read_probe(self, *, wait: bool) -> None:
        if self._probe is None or not (wait or self._probe[1].is_ready()):
            return
        where, fraction = self._probe
        self._probe = None
        fraction = float(jax.device_get(fraction))
        if fraction:
            probability_check.warn(self._spec, fraction, where)

    def _where(self, first: int, last: int) -> str:
        if first == last:
            return f"{self._what} {first}{self._context}"
        return f"{self._what}s {first} to {last}{self._context} (one execution)"

    def _check(self, first: int, last: int, flags: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in jax.device_get(flags).items()}
        where = self._where(first, last)
        if values.get(LABELS):
            self._pending.clear()
            raise ValueError(
                f"Check numerics: class labels outside [0, num_classes) at {where}: a sparse "
                "categorical loss or metric got an integer label that is negative or not "
                "below the model's number of outputs. Fix the labels, or give the model one "
                "output per class."
            )
        if values.get(LOSS):
            self._pending.clear()
            raise FloatingPointError(
                f"Check numerics: the loss is NaN or infinite at {where}. Look for NaN or "
                "inf in the inputs and labels, lower the learning rate, or compute the loss "
                "from logits (from_logits=True)."
            )
        if values.get(GRADIENTS):
            self._pending.clear()
            raise FloatingPointError(
                f"Check numerics: the gradients are NaN or infinite at {where}, while the "
                "loss is finite. Lower the learning rate, clip gradients (e.g. "
                "optax.clip_by_global_norm), or look for an operation whose gradient "
                "overflows (sqrt or log near 0, exp of large values)."
            )
        if values.get(FLOOR):
            self._pending.clear()
            raise FloatingPointError(
                f"Check numerics: the gradients overflow float16 even at the loss scale's "
                f"floor at {where}: the step was skipped (dynamic loss scaling skips steps "
                f"whose gradients are not finite), and at the floor every such step is "
                f"skipped without the scale getting any lower. {_FLOOR_FIX}"
            )
