"""The ONE step body: per-replica gradients, the update, evaluation and prediction.

Every training path wraps the functions here: `make_train_step`, `jstrategy.Model.fit` with
any ``steps_per_execution`` (a ``lax.scan`` of this step), `CentralStorageStrategy`'s host
update, `ParameterServerStrategy`'s `fit` (the gradients on a worker) and evaluation (the
same loss and metric sums, without gradients). How the step becomes programs is the
strategy's decision (`Strategy.stage_train_step`); what it computes is decided here.

Inside, each replica computes the mask-weighted *sum* of its per-example losses; the step
differentiates the replicas' sums times the reciprocal of the global count of real rows
(`_gradients`), the mean over real rows of the global batch: padding never skews it, and
every strategy follows the same trajectory as `OneDeviceStrategy` up to float rounding.
How the replicas are traced and their gradients, sums and mutable state combined is the
staging's (`views`: inside a region manual over the data axis, ONE call to
``strategy.cross_device_ops.all_reduce``; in the global view, the replicas' ``vmap``).

The step's options (`StepSpec`) act in two places. The precision policy casts the
parameters and floating inputs to its compute dtype inside the differentiated function (so
the gradients come back in the variable dtype) and the outputs to float32 before the loss
and metrics (`_forward`). A `DynamicLossScale` in the state scales the loss before
differentiating and unscales the combined gradients (`_finish`); the update
(`apply_update`) is skipped, the scale halved, when they are not finite, a decision taken
on values identical on every replica. With ``accumulation_steps`` k > 1 the gradient sums
and counts of real rows go to `accumulation.accumulate`, which updates every k-th step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jstrategy._src import trace_context
from jstrategy._src.numerics import COUNT
from jstrategy._src.numerics import WEIGHT_SUM
from jstrategy._src.numerics import means
from jstrategy._src.numerics import per_example
from jstrategy._src.numerics import row_count
from jstrategy._src.numerics import weight_key
from jstrategy._src.pipeline import repeated
from jstrategy._src.pipeline.loss import ReplicaSlices
from jstrategy._src.pipeline.loss import microbatch
from jstrategy._src.pipeline.loss import replica_loss
from jstrategy._src.placement import abstract
from jstrategy._src.placement import create_placed
from jstrategy._src.precision import policy as mp
from jstrategy._src.precision.loss_scale import all_finite
from jstrategy._src.precision.loss_scale import select_if_finite
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.staging import StepFunctions
from jstrategy._src.staging import TrainProgram
from jstrategy._src.staging import replica_map
from jstrategy._src.staging import row_spec
from jstrategy._src.staging import rows_beyond_data_axis
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib
from jstrategy._src.training.data_adapters import unpack_batch
from jstrategy._src.training.per_example import samplewise
from jstrategy._src.training.per_example import weighted_values
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.global_batch import as_batch_norm_sync
from jstrategy._src.training.state.train_state import TrainStateProtocol
from jstrategy._src.training.state.train_state import loss_scale_for
from jstrategy._src.training.state.train_state import uses_loss_scale
from jstrategy._src.training.step import accumulation
from jstrategy._src.training.step import check_numerics
from jstrategy._src.training.step import probability_check
from jstrategy._src.training.step import remat as remat_lib
from jstrategy._src.training.step import views
from jstrategy._src.training.step.spec import Metric
from jstrategy._src.training.step.spec import StepSpec
from jstrategy._src.validation import check_positive_int

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = [
    "StepSpec",
    "apply_update",
    "build_eval_program",
    "build_predict_program",
    "build_train_program",
    "eval_sums",
    "global_gradients",
    "predict_outputs",
    "prepare_state",
    "replica_gradients",
    "resolve_loss",
    "resolve_metrics",
    "step_functions",
]
_FLOAT32 = mp.Policy("float32")


def resolve_loss(loss: Any) -> losses_lib.Loss:
    """A `Loss` from a name, a Loss object or a callable (see `jstrategy.losses.get`)."""
    if loss is None:
        raise ValueError(
            "`loss` must be a loss name (e.g. 'mse'), a jstrategy.losses object or a "
            "callable (y_true, y_pred) -> per-example losses; got None."
        )
    resolved = losses_lib.get(loss)
    refused = (losses_lib.Reduction.SUM, losses_lib.Reduction.MEAN_WITH_SAMPLE_WEIGHT)
    if resolved.reduction in refused:
        raise ValueError(
            f"The train step takes Keras's 'sum_over_batch_size' loss over the real rows of "
            f"the global batch; got {resolved!r} with reduction="
            f"'{resolved.reduction.value}', which it would not honour (its value depends on "
            "how the data is cut into batches and replicas). Pass the loss with "
            "reduction='sum_over_batch_size' (the default) or 'none' (the step reduces "
            "the same way either way), and scale the learning rate if you meant a sum."
        )
    return resolved


def resolve_metrics(
    metrics: Any, loss: Any = None, *, taken: Sequence[str] = ()
) -> list[tuple[str, Metric]]:
    """``(name, metric)`` pairs from names, Metric objects or callables.

    `taken` are the names of the (unweighted) metrics when resolving
    ``weighted_metrics``: a weighted metric of the same name is logged as
    ``"weighted_" + name``, as in Keras.
    """
    if metrics is None:
        return []
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    out: list[tuple[str, Metric]] = []
    for identifier in metrics:
        metric = metrics_lib.get(identifier, loss=loss)
        name = f"weighted_{metric.name}" if metric.name in taken else metric.name
        if (
            name in (COUNT, "loss", *taken)
            or name.startswith(WEIGHT_SUM)
            or any(name == n for n, _ in out)
        ):
            raise ValueError(
                f"Metric names must be unique, not 'loss' or 'count' and not start with "
                f"{WEIGHT_SUM!r}; got {name!r} after {[*taken, *(n for n, _ in out)]}. Give "
                "the metric another `name`."
            )
        out.append((name, metric))
    return out


def make_spec(
    loss: Any,
    metrics: Any,
    strategy: Strategy,
    *,
    dtype_policy: mp.Policy | str | None = None,
    gradient_accumulation_steps: int = 1,
    weighted_metrics: Any = None,
    sync_batch_norm: BatchNormSync | str = BatchNormSync.GLOBAL,
    remat: Any = None,
) -> StepSpec:
    """The `StepSpec` of a loss (or None), metrics and options given as `compile` takes them.

    `dtype_policy` None means `jstrategy.mixed_precision.global_policy()`, read now.
    """
    loss_fn = resolve_loss(loss) if loss is not None else None
    plain = tuple(resolve_metrics(metrics, loss=loss_fn))
    weighted = resolve_metrics(weighted_metrics, loss=loss_fn, taken=[n for n, _ in plain])
    return StepSpec(
        strategy,
        loss_fn,
        plain,
        weighted_metrics=tuple(weighted),
        policy=mp.as_policy(dtype_policy, argument="dtype_policy"),
        accumulation_steps=check_positive_int(
            gradient_accumulation_steps,
            "gradient_accumulation_steps",
            "1 updates every step; k > 1 updates once every k micro-batches.",
        ),
        check_numerics=check_numerics.check_numerics_enabled(),
        sync_batch_norm=as_batch_norm_sync(sync_batch_norm),
        remat=remat_lib.resolve_remat(remat),
        pipeline=strategy.pipeline,
    )


def prepare_state(spec: StepSpec, state: TrainStateProtocol) -> Any:
    """`state` with what the train step keeps in it, added (placed) where it is missing.

    A float16 compute dtype needs a loss scale (``state.loss_scale``, a
    `jstrategy.mixed_precision.DynamicLossScale` with Keras's defaults, as Keras wraps the
    optimizer in a `LossScaleOptimizer`); ``accumulation_steps`` > 1 needs gradient
    accumulators (``state.grad_accumulator``). A state that has them is returned as it is,
    so a cycle in progress (e.g. restored from a checkpoint) continues.

    Raises:
      ValueError: if the state holds gradient accumulators but the step does not
        accumulate (their pending sums would be ignored).
    """
    wanted: list[str] = []
    if state.loss_scale is None and uses_loss_scale(spec.policy):
        wanted.append("loss_scale")
    if spec.accumulation_steps > 1 and state.grad_accumulator is None:
        wanted.append("grad_accumulator")
    if spec.accumulation_steps == 1 and state.grad_accumulator is not None:
        raise ValueError(
            "The state holds gradient accumulators (`state.grad_accumulator`, from a step "
            "with gradient_accumulation_steps > 1), but this step has "
            "gradient_accumulation_steps=1 and would ignore their pending sums. Build the "
            "step with the same gradient_accumulation_steps, or drop them with "
            "state.replace(grad_accumulator=None)."
        )
    if not wanted:
        return state
    shapes = jax.tree.map(abstract, state.params)

    def added() -> dict[str, Any]:
        new: dict[str, Any] = {}
        if "loss_scale" in wanted:
            new["loss_scale"] = loss_scale_for(spec.policy)
        if "grad_accumulator" in wanted:
            new["grad_accumulator"] = accumulation.GradientAccumulator.zeros(shapes)
        return new

    # Created where they live: split like their parameters under FSDP and ModelParallel.
    return state.replace(**create_placed(added, strategy=spec.strategy))


# ---------------------------------------------------------------------------------------
# The per-replica body (traced inside `staging.replica_map`)
# ---------------------------------------------------------------------------------------
def _per_row(values: Any, rows: int, what: str) -> jax.Array:
    return per_example(values, rows, what).astype(jnp.float32)


def _forward(
    policy: mp.Policy,
    state: TrainStateProtocol,
    params: Any,
    x: Any,
    *,
    train: bool,
    axis_name: str | None,
    sync_batch_norm: BatchNormSync = BatchNormSync.GLOBAL,
    row_mask: Any = None,
) -> tuple[Any, Any, Any]:
    """The model under `policy`: ``(y_pred in float32, model_state in the variable dtype,
    the model's own losses in float32 or None)``.

    Called inside the differentiated function, so the casts' gradients bring the gradients
    back to the parameters' dtype. Under ``"float32"`` nothing is cast.
    """
    options: dict[str, Any] = {
        "train": train,
        "axis_name": axis_name,
        "sync_batch_norm": sync_batch_norm,
        "row_mask": row_mask,
    }
    if policy == _FLOAT32:
        return state.forward_with_losses(params, x, **options)
    params, x = mp.cast_to_compute((params, x), policy)
    y_pred, model_state, model_loss = state.forward_with_losses(params, x, **options)
    return mp.cast_to_float32(y_pred), mp.cast_to_variable(model_state, policy), model_loss


def _loss_scale_factor(spec: StepSpec, rest: Any, rows: int) -> jax.Array | None:
    """What a replica multiplies its loss *sum* by before differentiating, or None.

    The loss scale divided by the global batch's (static) number of `rows`: the scale then
    multiplies the mean loss, as in Keras, so a given scale overflows float16 at the same
    gradients whatever the batch size.
    """
    ls = rest.loss_scale
    if ls is None:
        return None
    return ls.loss_scale / rows


def row_weights(mask: jax.Array | None, rows: int) -> jax.Array:
    """The float row mask; for ``mask=None`` (a full batch: every row real) all ones.

    Full batches run without a mask argument: the ones are constants the compiler folds, so
    the program has no mask to read and its count of real rows is the static batch size
    (`replica_gradients` then all-reduces no count). The programs then equal a step written
    for full batches by hand; a batch with padding passes its mask and gets its own program.
    """
    if mask is None:
        return jnp.ones((rows,), jnp.float32)
    return mask.astype(jnp.float32)


def _batch_rows(batch: Any, mask: jax.Array | None) -> int:
    """The batch's leading rows (as the mask has them, or its inputs when it has none)."""
    return row_count(unpack_batch(batch)[0], "x") if mask is None else mask.shape[0]


def _row_mask(maskf: jax.Array, values: jax.Array) -> jax.Array:
    return maskf.reshape(maskf.shape + (1,) * (values.ndim - 1))


def _loss_sum(
    spec: StepSpec, y: Any, y_pred: Any, maskf: jax.Array, w: Any, model_loss: Any = None
) -> jax.Array:
    """One replica's weighted loss sum over the elements of its real rows, divided by the
    elements per row (training and evaluation alike).

    Divided by the global count of real rows, it is Keras's ``"sum_over_batch_size"``
    loss: the loss per element (``(b, t)`` for sequence outputs), times its sample weight
    (per row or per element, a padding mask say), summed and divided by the number of
    elements, ``rows * t``. The model's own losses (`model_loss`: regularization
    penalties, the same on every replica) count once per real row, so the division adds
    them once to the mean loss, as Keras adds ``model.losses``.
    """
    assert spec.loss is not None
    values = spec.loss.values(y, y_pred).astype(jnp.float32)  # type: ignore[attr-defined]
    values = weighted_values(values, w, "The loss")
    values = values * _row_mask(maskf, values)
    per_row = values.size // maskf.shape[0]
    total = jnp.sum(values)
    total = total if per_row == 1 else total / per_row
    if model_loss is None:
        return total
    return total + model_loss * jnp.sum(maskf)


def _sums(
    spec: StepSpec, y: Any, y_pred: Any, maskf: jax.Array, loss_sum: Any, w: Any
) -> dict[str, jax.Array]:
    """The loss sum, each metric's sum over real rows and the count of real rows.

    A metric is the mean of its rows' values (each row's mean over its time steps), as
    Keras's ``Mean`` of unweighted values. A weighted metric (`StepSpec.weighted_metrics`)
    also sums its rows' weights (`samplewise`), the denominator of its mean. A loss that
    expects probabilities adds its count of rows that are not (`probability_check`).
    """
    rows = maskf.shape[0]
    out: dict[str, jax.Array] = {}
    if loss_sum is not None:
        out["loss"] = loss_sum
    for name, fn in spec.metrics:
        values = fn.per_example(y, y_pred)  # type: ignore[attr-defined]
        out[name] = jnp.sum(_per_row(values, rows, f"The metric {name!r}") * maskf)
    for name, fn in spec.weighted_metrics:
        values = fn.values(y, y_pred).astype(jnp.float32)  # type: ignore[attr-defined]
        values, weights = samplewise(values, w, f"The weighted metric {name!r}")
        out[name] = jnp.sum(values * maskf)
        out[weight_key(name)] = jnp.sum(maskf if weights is None else weights * maskf)
    out[COUNT] = jnp.sum(maskf)
    out.update(probability_check.count(spec, y_pred, maskf))
    return out


def _replica_loss(
    spec: StepSpec,
    rest: TrainStateProtocol,
    batch: Any,
    mask: jax.Array,
    scale: Any,
    slices: tuple[ReplicaSlices, list[Any]] | None = None,
) -> tuple[Callable[[Any], tuple[jax.Array, tuple[Any, Any, Any]]], Any, jax.Array]:
    """One replica's differentiated function, its labels and its float row mask.

    The function maps the parameters to ``(scaled loss sum, (loss sum, y_pred,
    model_state))``: the forward pass over this replica's rows in training mode, the
    replicas named by ``spec.strategy.axis_name`` (dropout keys, synchronized BatchNorm).
    How the forward pass and the loss sums are put together is the pipeline's
    (`pipeline.loss.replica_loss`): the forward pass over the whole batch, or under a 1F1B
    pipeline each microbatch's loss inside the schedule (`slices`: in the global view the
    repeated block's leaves split over the replicas, and this replica's slices of them).
    """
    axis = spec.strategy.axis_name
    x, y, w = unpack_batch(batch)
    if y is None:
        raise ValueError("A training batch must be (x, y) or (x, y, sample_weight); got no y.")
    maskf = row_weights(mask, _batch_rows(batch, mask))

    def forward(params: Any, x: Any) -> tuple[Any, Any, Any]:
        return _forward(
            spec.policy,
            rest,
            params,
            x,
            train=True,
            axis_name=axis,
            sync_batch_norm=spec.sync_batch_norm,
            row_mask=mask,
        )

    def scaled_loss(loss_sum: jax.Array) -> jax.Array:
        scaled = loss_sum if scale is None else loss_sum * scale
        if spec.loss_scale_factor is not None:
            scaled = scaled * spec.loss_scale_factor
        return scaled

    def loss_sum(y_pred: Any, m: Any) -> jax.Array:
        if m is None:
            return _loss_sum(spec, y, y_pred, maskf, w)
        # Microbatch m's rows of the labels, weights and mask (`one_f_one_b_loss`).
        size = row_count(y_pred, "y_pred")
        y_m, maskf_m, w_m = microbatch((y, maskf, w), maskf.shape[0], m, size)
        return _loss_sum(spec, y_m, y_pred, maskf_m, w_m)

    def penalty(model_loss: Any) -> jax.Array:
        return jnp.zeros(()) if model_loss is None else model_loss * jnp.sum(maskf)

    def compute_params(params: Any) -> Any:
        return params if spec.policy == _FLOAT32 else mp.cast_to_compute(params, spec.policy)

    run = replica_loss(spec.pipeline)

    def local_loss(params: Any) -> tuple[jax.Array, tuple[Any, Any, Any]]:
        return run(
            params,
            x,
            forward=forward,
            cast=compute_params,
            loss_sum=loss_sum,
            penalty=penalty,
            scaled=scaled_loss,
            slices=slices,
        )

    return local_loss, y, maskf


def _finish(
    spec: StepSpec,
    rest: TrainStateProtocol,
    grads: Any,
    sums: dict[str, jax.Array],
    scale: Any,
    *,
    of_mean: bool,
) -> Any:
    """The summed gradients as the update takes them: unscaled, then divided by the global
    count of real rows (or, accumulating, paired with it as `GradientSums`). Adds to `sums`
    whether apply_update will skip this step with the loss scale at its floor (fit warns).

    `of_mean`: the gradients are already those of the mean loss (`_gradients`
    differentiates the loss sum times the count's reciprocal), so they are not divided
    again."""
    if scale is not None:  # an overflow stays inf or NaN: apply_update sees it
        grads = jax.tree.map(lambda g: (g / scale).astype(g.dtype), grads)
    sums.update(check_numerics.loss_scale_flags(spec, rest.loss_scale, grads))
    if spec.accumulation_steps > 1:
        return accumulation.GradientSums(grads, sums[COUNT])
    if of_mean:
        return grads
    denom = jnp.maximum(sums[COUNT], 1.0)
    return jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)


def _gradients(
    spec: StepSpec,
    view: views.View,
    params: Any,
    rest: TrainStateProtocol,
    batch: Any,
    mask: jax.Array | None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """The step's gradients: ``(grads, model_state, sums)``, combined across replicas.

    The gradients are those of the mean loss over the global batch's real rows with
    respect to `params`; `rest` is the rest of the state (`TrainStateProtocol.replica_view`).
    The new mutable state (e.g. BatchNorm statistics) is averaged over replicas, as
    tf.distribute aggregates such variables with MEAN. With ``spec.accumulation_steps`` >
    1 the gradients are `accumulation.GradientSums`: the gradient of the loss *sum* and the
    count of real rows, which `apply_update` adds to the cycle's. The model is traced in
    the step's one `trace_context.TraceContext`: its remat policy, its pipeline, where
    the marked blocks' inputs are placed and the view's context axis.
    """
    batch, mask = view.arriving(batch, mask)
    rows = _batch_rows(batch, mask)
    scale = _loss_scale_factor(spec, rest, view.global_rows(rows))
    # The mean over the global batch's real rows is differentiated, not the sum divided
    # afterwards: the count depends on the mask alone, and a factor applied to every
    # gradient after the backward pass made XLA keep every gradient shard until the last
    # was produced (FSDP peaked at 0.50x one parameter copy where the hand-written step
    # needs 0.43x, for models whose blocks' names sort before their head's), where the
    # factor seeding the backward pass lets each update run as its gradient is ready.
    # Not under a loss scale: its overflows must be those of the scaled loss *sum* (and
    # its all-finite check waits for every gradient anyway), nor when accumulating (the
    # cycle adds sums).
    of_mean = spec.accumulation_steps == 1 and scale is None
    count = view.count(rows, mask) if of_mean or mask is None else None
    factor = None  # a full batch divides by its static size, a padded one by its count
    if of_mean and count is not None:
        factor = 1.0 / (count if mask is None else jnp.maximum(count, 1.0))

    def one_replica(params: Any, slices: Any, batch: Any, mask: Any) -> tuple[jax.Array, Any]:
        local_loss, y, maskf = _replica_loss(spec, rest, batch, mask, scale, slices)
        scaled, (loss_sum, y_pred, model_state) = local_loss(params)
        sums = _sums(spec, y, y_pred, maskf, loss_sum, unpack_batch(batch)[2])
        if spec.check_numerics:
            sums.update(check_numerics.step_flags(spec, y, y_pred, maskf, loss_sum))
        return scaled, (sums, view.replica_state(model_state))

    replicas, at = view.differentiable(one_replica, spec, params)

    def total(params: Any) -> tuple[jax.Array, Any]:
        scaled, aux = replicas(params, batch, mask)
        return (scaled if factor is None else scaled * factor), aux

    remat = remat_lib.record(spec.remat)
    context = dataclasses.replace(
        trace_context.current(),
        remat=remat,
        pipeline=repeated.tracing_for(
            spec.pipeline,
            params,
            view.replica_rows(rows),
            remat=None if remat is None else remat.policy,
        ),
        activation_rows=view.placement(spec),
        context_axis=view.context_axis,
    )
    with trace_context.tracing(context):
        (_, (sums, model_state)), grads = jax.value_and_grad(total, has_aux=True)(at)
    remat_lib.check_used(remat)
    # Under loss scaling, overflowing gradients are expected: the step is skipped.
    checked = spec.check_numerics and scale is None
    grads, sums, model_state = view.reduce(grads, sums, model_state, count, checked)
    return _finish(spec, rest, grads, sums, scale, of_mean=of_mean), model_state, sums


def replica_gradients(
    spec: StepSpec,
    params: Any,
    rest: TrainStateProtocol,
    batch: Any,
    mask: jax.Array,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One replica's `_gradients`, traced inside a region manual over the data axis
    (`staging.replica_map`); everything it returns is identical on every replica."""
    return _gradients(spec, views.Manual(spec.strategy), params, rest, batch, mask)


def global_gradients(
    spec: StepSpec, params: Any, rest: TrainStateProtocol, batch: Any, mask: jax.Array
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """`_gradients` traced in the global view (no manual mesh axis; see `views.Global`)."""
    return _gradients(spec, views.Global(spec.strategy), params, rest, batch, mask)


def apply_update(spec: StepSpec, state: TrainStateProtocol, grads: Any, model_state: Any) -> Any:
    """The optimizer update: every staged step applies its update through this function.

    `grads` are what `replica_gradients` returned (identical on every replica, or global).
    With a loss scale in the state, non-finite gradients skip the update: the state is
    kept whole (parameters, optimizer state, step, accumulators, model state) and only the
    scale is adjusted, so every replica takes the same decision in the same step.
    """
    ls = state.loss_scale
    if spec.accumulation_steps > 1:
        if state.grad_accumulator is None:
            raise ValueError(
                f"gradient_accumulation_steps={spec.accumulation_steps} needs gradient "
                "accumulators in the state; pass the state through the train step's "
                "prepare_state(state) first."
            )
        new = accumulation.accumulate(state, grads, model_state, spec.accumulation_steps)
    else:
        new = state.apply_update(grads, model_state)
    if ls is None:
        return new
    finite = all_finite(grads)
    return select_if_finite(finite, new, state).replace(loss_scale=ls.adjust(finite))


def eval_sums(
    spec: StepSpec,
    state: TrainStateProtocol,
    batch: Any,
    mask: jax.Array,
    *,
    across_replicas: bool = True,
) -> dict[str, jax.Array]:
    """One evaluation step on one replica: the loss and metric sums, combined across
    replicas (`across_replicas`; a global-view program's batch is every replica's)."""
    strategy = spec.strategy
    x, y, w = unpack_batch(batch)
    if y is None:
        raise ValueError("An evaluation batch must be (x, y) or (x, y, sample_weight).")
    maskf = row_weights(mask, _batch_rows(batch, mask))
    y_pred, _, model_loss = _forward(
        spec.policy, state, state.params, x, train=False, axis_name=None
    )
    loss_sum = None
    if spec.loss is not None:
        loss_sum = _loss_sum(spec, y, y_pred, maskf, w, model_loss)
    sums = _sums(spec, y, y_pred, maskf, loss_sum, w)
    if spec.check_numerics:
        sums.update(check_numerics.step_flags(spec, y, y_pred, maskf, loss_sum))
    if across_replicas:
        sums = strategy.cross_device_ops.all_reduce(
            ReduceOp.SUM, sums, mesh=strategy.mesh, axis_name=strategy.axis_name
        )
    return {**sums, **check_numerics.loss_scale_flags(spec)}  # the train step's keys


def predict_outputs(policy: mp.Policy, state: TrainStateProtocol, x: Any) -> Any:
    """The model's outputs in inference mode (floating outputs in float32 under a policy
    other than ``"float32"``)."""
    y_pred, _, _ = _forward(policy, state, state.params, x, train=False, axis_name=None)
    return y_pred


def _split(state: TrainStateProtocol) -> tuple[Any, Any]:
    return state.params, state.replica_view()


def step_functions(spec: StepSpec) -> StepFunctions:
    """The step as `Strategy.stage_train_step` takes it."""

    def gradients(params: Any, rest: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        return replica_gradients(spec, params, rest, batch, mask)

    def gradients_global(params: Any, rest: Any, batch: Any, mask: Any) -> tuple[Any, Any, Any]:
        return global_gradients(spec, params, rest, batch, mask)

    def update(state: Any, grads: Any, model_state: Any) -> Any:
        return apply_update(spec, state, grads, model_state)

    def gradients_like(per_param: Any, scalar: Any) -> Any:
        if spec.accumulation_steps > 1:
            return accumulation.GradientSums(per_param, scalar)
        return per_param

    return StepFunctions(
        split=_split,
        gradients=gradients,
        update=update,
        gradients_like=gradients_like,
        global_gradients=gradients_global,
    )


# ---------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------
def build_train_program(spec: StepSpec, *, steps: int = 0, stacked: bool = True) -> TrainProgram:
    """``(state, acc, batch, mask) -> (state, acc, logs)`` running `steps` steps.

    `acc` holds running sums (and the count of real rows) that the steps add to (None: the
    sums of one step); `logs` are their means. With ``steps=0`` the batch is a single
    batch (leaves ``(B, ...)``); otherwise `stacked` batches have leaves ``(steps, B,
    ...)`` and mask ``(steps, B)``, while unstacked ones are tuples of `steps` batches and
    masks. The strategy stages it (`Strategy.stage_train_step`).
    """
    return spec.strategy.stage_train_step(step_functions(spec), steps=steps, stacked=stacked)


class _ReadingState:
    """A program ``(state, *args)`` given the state as the replicas read it."""

    def __init__(self, program: Any, strategy: Strategy):
        self._program = program
        self._strategy = strategy

    def _state(self, state: TrainStateProtocol) -> Any:
        # The optimizer state is not needed to evaluate or predict.
        return self._strategy.read_on_replicas(state.replica_view(with_params=True))

    def __call__(self, state: TrainStateProtocol, *args: Any) -> Any:
        return self._program(self._state(state), *args)

    def lower(self, state: TrainStateProtocol, *args: Any) -> Any:
        return self._program.lower(self._state(state), *args)


def build_eval_program(spec: StepSpec) -> Callable[..., Any]:
    """``(state, acc, batch, mask) -> (acc, logs)`` for one evaluation batch (`acc` None:
    this batch's sums only)."""
    strategy = spec.strategy

    def eval_program(state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any]:
        sums = eval_sums(spec, state, batch, mask)
        acc = sums if acc is None else jax.tree.map(jnp.add, acc, sums)
        return acc, means(acc)

    if rows_beyond_data_axis(strategy):

        def global_eval(state: Any, acc: Any, batch: Any, mask: Any) -> tuple[Any, Any]:
            sums = eval_sums(spec, state, batch, mask, across_replicas=False)
            acc = sums if acc is None else jax.tree.map(jnp.add, acc, sums)
            return acc, means(acc)

        return _ReadingState(
            _UnderMesh(jax.jit(global_eval, donate_argnums=(1,)), strategy), strategy
        )
    rows = row_spec(strategy)
    program = jax.jit(
        replica_map(strategy, eval_program, in_specs=(P(), P(), rows, rows), out_specs=(P(), P())),
        donate_argnums=(1,),
    )
    return _ReadingState(program, strategy)


def build_predict_program(strategy: Strategy, policy: mp.Policy = _FLOAT32) -> Callable[..., Any]:
    """``(state, x) -> y_pred`` with outputs split by rows like the inputs."""
    rows = row_spec(strategy)

    def predict(state: Any, x: Any) -> Any:
        return predict_outputs(policy, state, x)

    if rows_beyond_data_axis(strategy):
        by_rows = strategy.batch_sharding()
        return _ReadingState(
            _UnderMesh(jax.jit(predict, out_shardings=by_rows), strategy), strategy
        )
    program = jax.jit(replica_map(strategy, predict, in_specs=(P(), rows), out_specs=rows))
    return _ReadingState(program, strategy)


class _UnderMesh:
    """A program called (hence traced) under its strategy's mesh and logical rules."""

    def __init__(self, program: Any, strategy: Strategy):
        self._program = program
        self._strategy = strategy

    def _context(self) -> Any:
        enter = getattr(self._strategy, "mesh_context", None)
        return contextlib.nullcontext() if enter is None else enter()

    def __call__(self, *args: Any) -> Any:
        with self._context():
            return self._program(*args)

    def lower(self, *args: Any) -> Any:
        with self._context():
            return self._program.lower(*args)
