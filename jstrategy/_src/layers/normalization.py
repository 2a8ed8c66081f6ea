"""Keras's normalization layers as linen modules: `BatchNormalization`, `LayerNormalization`.

Keras's names and defaults: ``gamma``/``beta`` are trained (``params``),
``moving_mean``/``moving_variance`` are BatchNorm's statistics (``batch_stats``, updated
by the train step); momentum 0.99, epsilon 1e-3. Statistics are computed in float32 for
float16 and bfloat16 inputs, as Keras does. In a train step, the statistics are the global
batch's under every strategy (`batch_region`), as on one device.
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jstrategy._src import batch_region
from jstrategy._src import context
from jstrategy._src.layers import initializers
from jstrategy._src.layers import regularizers
from jstrategy._src.layers import weights
from jstrategy._src.layers.base import Layer
from jstrategy._src.registry import register_saveable
from jstrategy._src.strategy import REPLICA_AXIS
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_number
from jstrategy._src.validation import is_int

__all__ = ["BatchNormalization", "LayerNormalization"]


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"`axis` {axis!r} is out of range for inputs of rank {ndim}.")
    return tuple(sorted(a % ndim for a in axes))


def _check_axis(axis: Any) -> None:
    ok = is_int(axis) or (isinstance(axis, (tuple, list)) and axis and all(map(is_int, axis)))
    if not ok:
        raise ValueError(f"`axis` must be an int or a tuple of ints; got {axis!r}. E.g. -1.")


def _check_epsilon(epsilon: Any) -> None:
    check_number(epsilon, "epsilon", low=0, low_open=True, fix="E.g. 1e-3.")


def _float32(x: Any) -> Any:
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


class _Normalization(Layer):
    """``gamma``/``beta`` over the feature axes, shared by both layers."""

    has_weights: ClassVar[bool] = True

    def _affine(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
        gamma = beta = None
        if self.scale:  # type: ignore[attr-defined]
            gamma = self.param(
                "gamma",
                initializers.get(self.gamma_initializer, "gamma_initializer"),  # type: ignore[attr-defined]
                shape,
                jnp.float32,
            )
            regularizers.add_weight_loss(self, "gamma", gamma, self.gamma_regularizer)  # type: ignore[attr-defined]
        if self.center:  # type: ignore[attr-defined]
            beta = self.param(
                "beta",
                initializers.get(self.beta_initializer, "beta_initializer"),  # type: ignore[attr-defined]
                shape,
                jnp.float32,
            )
            regularizers.add_weight_loss(self, "beta", beta, self.beta_regularizer)  # type: ignore[attr-defined]
        return gamma, beta

    @staticmethod
    def _check_common(self: Any) -> None:
        _check_axis(self.axis)  # type: ignore[attr-defined]
        _check_epsilon(self.epsilon)  # type: ignore[attr-defined]
        check_bool(self.center, "center")  # type: ignore[attr-defined]
        check_bool(self.scale, "scale")  # type: ignore[attr-defined]
        for name in ("beta_initializer", "gamma_initializer"):
            initializers.get(getattr(self, name), name)
        for name in ("beta_regularizer", "gamma_regularizer"):
            object.__setattr__(self, name, regularizers.get(getattr(self, name), name))
        weights.resolve_constraints(self, "beta", "gamma")


def _normalize(x: Any, mean: Any, var: Any, gamma: Any, beta: Any, epsilon: float) -> Any:
    inv = jax.lax.rsqrt(var + epsilon)
    if gamma is not None:
        inv = inv * gamma
    out = x * inv - mean * inv
    return out + beta if beta is not None else out


@register_saveable(kind="layer")
class BatchNormalization(_Normalization):
    """Keras's ``BatchNormalization``: batch statistics in training, moving ones otherwise.

    In a train step (`Model.fit`, `jstrategy.training.make_train_step`) the statistics are
    the global batch's under every strategy, as on one device and as Keras 3's
    ``DataParallel`` computes them; ``compile(sync_batch_norm="per_replica")`` (or the
    train step's ``sync_batch_norm=``) takes each replica's rows instead, as TF's
    ``BatchNormalization`` does under a ``tf.distribute`` strategy, and the moving
    statistics are then the replicas' mean. ``synchronized=True`` asks for the global
    batch's statistics even then, and inside `Strategy.run` (over the strategy's data
    axis, or `jstrategy.REPLICA_AXIS` in a ``shard_map`` of your own), where the default
    normalizes each replica's rows as TF does. Outside any of these the rows given are
    the batch.

    Example:

    >>> import jax, jax.numpy as jnp
    >>> layer = BatchNormalization()
    >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> sorted(variables["params"]), sorted(variables["batch_stats"])
    (['beta', 'gamma'], ['moving_mean', 'moving_variance'])
    """

    axis: Any = -1
    momentum: float = 0.99
    epsilon: float = 1e-3
    center: bool = True
    scale: bool = True
    beta_initializer: Any = "zeros"
    gamma_initializer: Any = "ones"
    moving_mean_initializer: Any = "zeros"
    moving_variance_initializer: Any = "ones"
    beta_regularizer: Any = None
    gamma_regularizer: Any = None
    beta_constraint: Any = None
    gamma_constraint: Any = None
    synchronized: bool = False
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        _Normalization._check_common(self)
        check_number(self.momentum, "momentum", low=0, high=1, fix="E.g. 0.99.")
        check_bool(self.synchronized, "synchronized")
        for name in ("moving_mean_initializer", "moving_variance_initializer"):
            initializers.get(getattr(self, name), name)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        training = training and self.trainable  # Keras 3: frozen, it runs in inference mode
        x = _float32(inputs)
        axes = _axes(self.axis, x.ndim)
        feature_shape = tuple(x.shape[a] for a in axes)
        stat_shape = tuple(x.shape[a] if a in axes else 1 for a in range(x.ndim))
        reduce = tuple(a for a in range(x.ndim) if a not in axes)
        moving_mean = self.variable(
            "batch_stats",
            "moving_mean",
            lambda: initializers.get(self.moving_mean_initializer, "moving_mean_initializer")(
                jax.random.key(0), feature_shape, jnp.float32
            ),
        )
        moving_var = self.variable(
            "batch_stats",
            "moving_variance",
            lambda: initializers.get(
                self.moving_variance_initializer, "moving_variance_initializer"
            )(jax.random.key(0), feature_shape, jnp.float32),
        )
        gamma, beta = self._affine(feature_shape)
        if training:
            region = batch_region.current()
            mask = None if region is None else region.row_mask
            mean, var = batch_region.moments(x, reduce, self._statistics_axis(), mask)
            if not self.is_initializing():
                m = self.momentum
                moving_mean.value = moving_mean.value * m + mean * (1 - m)
                moving_var.value = moving_var.value * m + var * (1 - m)
        else:
            mean, var = moving_mean.value, moving_var.value
        out = _normalize(
            x,
            mean.reshape(stat_shape),
            var.reshape(stat_shape),
            None if gamma is None else gamma.reshape(stat_shape),
            None if beta is None else beta.reshape(stat_shape),
            self.epsilon,
        )
        return out.astype(inputs.dtype)

    def _statistics_axis(self) -> str | None:
        """The data axis the training statistics are averaged over, or None (these rows)."""
        region = batch_region.current()
        if region is not None:
            return region.axis_name if region.sync_batch_norm or self.synchronized else None
        if not self.synchronized or self.is_initializing():
            return None
        replica_context = context.inside_run()
        if replica_context is not None:
            return replica_context.strategy.axis_name
        # A shard_map of one's own over jstrategy's replica axis, or no replicas at all.
        return REPLICA_AXIS if batch_region.axis_bound(REPLICA_AXIS) else None


@register_saveable(kind="layer")
class LayerNormalization(_Normalization):
    """Keras's ``LayerNormalization``: each row normalized over `axis` (epsilon 1e-3).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> layer = LayerNormalization()
    >>> y = layer.apply(layer.init(jax.random.key(0), x), x)
    >>> [round(float(v), 3) for v in y[0]]
    [-1.224, 0.0, 1.224]
    """

    axis: Any = -1
    epsilon: float = 1e-3
    center: bool = True
    scale: bool = True
    beta_initializer: Any = "zeros"
    gamma_initializer: Any = "ones"
    beta_regularizer: Any = None
    gamma_regularizer: Any = None
    beta_constraint: Any = None
    gamma_constraint: Any = None
    input_shape: Any = None

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        _Normalization._check_common(self)

    @nn.compact
    def __call__(self, inputs: Any, training: bool | None = None) -> Any:
        inputs = self.cast_inputs(inputs)
        x = _float32(inputs)
        axes = _axes(self.axis, x.ndim)
        stat_shape = tuple(x.shape[a] if a in axes else 1 for a in range(x.ndim))
        gamma, beta = self._affine(tuple(x.shape[a] for a in axes))
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.var(x, axis=axes, keepdims=True)
        out = _normalize(
            x,
            mean,
            var,
            None if gamma is None else gamma.reshape(stat_shape),
            None if beta is None else beta.reshape(stat_shape),
            self.epsilon,
        )
        return out.astype(inputs.dtype)
