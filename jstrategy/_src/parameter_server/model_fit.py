"""`jstrategy.Model.fit` under `ParameterServerStrategy`: asynchronous epochs on the workers.

`Model._train_epoch` hands an epoch to `train_model_epoch` when the model's strategy is a
`ParameterServerStrategy`. As Keras with TF's strategy, `steps_per_epoch` is required. The
model's parameters (and BatchNorm statistics) are `VariableTree`s on the parameter
servers, created at the first epoch with the compiled optimizer (run per variable there)
and kept across epochs and `fit` calls. The coordinator cuts the epoch's batches as the
model does for any strategy and schedules one step per batch; each worker pulls the
current parameters, computes the gradient of the mean loss over the batch's real rows on
its device (the loss and metric pieces of `train_step.py`, in one compiled program), and
pushes it. At the end of the epoch the coordinator waits for every step and copies the
parameters back into the model, so `evaluate`, `predict` and callbacks see them.
"""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jstrategy._src.parameter_server import backend as backend_lib
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.training import train_step as steps_lib
from jstrategy._src.values import varying_axes

__all__ = ["train_model_epoch"]

_COUNT = "count"


@dataclasses.dataclass
class _Session:
    """What a model keeps on a cluster between epochs."""

    coordinator: Any
    params: Any  # VariableTree of the parameters, with the optimizer
    batch_stats: Any  # VariableTree of BatchNorm statistics, or None
    synced_params: Any  # the model's params object the variables were last copied into
    step: int
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


_SESSIONS: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
# Compiled gradient programs by (session token, device), in whichever process runs them.
_PROGRAMS: dict[Any, Any] = {}


def _grad_program(spec: steps_lib.StepSpec, worker_strategy: Any) -> Any:
    """``(state, batch, mask) -> (grads, sums, new_batch_stats)`` on one worker's device.

    The per-replica body of `train_step.train_body` without the update: the gradient of
    the mask-weighted loss sum divided by the real rows, and the loss and metric sums.
    """
    axis = worker_strategy.axis_name
    mesh = worker_strategy.mesh

    def body(state, batch, mask):
        adapter = steps_lib._adapter_for(state)
        x, y, w = steps_lib.unpack_batch(batch)
        maskf = mask.astype(jnp.float32)
        weight = steps_lib._weights(maskf, w)
        rows = maskf.shape[0]

        def local_loss(params):
            y_pred, aux = adapter.forward(state, params, x, train=True, axis_name=axis)
            per = steps_lib._per_example(spec.loss(y, y_pred), rows, "loss")
            return jnp.sum(per * weight), (y_pred, aux)

        params = steps_lib._to_varying(adapter.params(state), axis)
        (loss_sum, (y_pred, aux)), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
        sums = steps_lib._sums(spec, y, y_pred, weight, maskf, loss_sum=loss_sum)
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        varying = [i for i, leaf in enumerate(aux_leaves) if axis in varying_axes(leaf)]
        grads, sums, synced = worker_strategy.cross_device_ops.all_reduce(
            ReduceOp.SUM, (grads, sums, [aux_leaves[i] for i in varying]), mesh=mesh
        )
        for i, leaf in zip(varying, synced, strict=True):
            aux_leaves[i] = leaf.astype(aux_leaves[i].dtype)
        denom = jnp.maximum(sums[_COUNT], 1.0)
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
        return grads, sums, jax.tree.unflatten(aux_tree, aux_leaves)

    rows = P(axis)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), rows, rows), out_specs=(P(), P(), P()))
    )


def _session(strategy: Any, model: Any) -> _Session:
    from jstrategy._src.parameter_server.coordinator import ClusterCoordinator

    state = model._state
    session = _SESSIONS.get(model)
    if session is not None and session.synced_params is state.params:
        return session
    if not hasattr(state, "batch_stats"):
        raise TypeError(
            "Model.fit under ParameterServerStrategy supports Flax linen modules; got a "
            f"{type(state).__name__}. Train NNX modules with a custom loop "
            "(strategy.create_variables and ClusterCoordinator)."
        )
    params = strategy.create_variables(jax.device_get(state.params), optimizer=state.tx)
    batch_stats = None
    if state.batch_stats is not None:
        batch_stats = strategy.create_variables(jax.device_get(state.batch_stats))
    session = _Session(
        coordinator=ClusterCoordinator(strategy),
        params=params,
        batch_stats=batch_stats,
        synced_params=state.params,
        step=int(state.step),
    )
    _SESSIONS[model] = session
    return session


def _step_fn(strategy: Any, spec: Any, session: _Session, template: Any):
    """The function scheduled for each batch: pull, compute, push; returns the sums."""
    params_tree = session.params
    stats_tree = session.batch_stats
    token = session.token

    def step(batch, mask, step_index):
        worker = backend_lib.current_worker()
        device = worker.device if worker is not None else strategy.devices[0]
        # Cached by module, not in the closure: with Ray the closure arrives anew each step.
        program = _PROGRAMS.get((token, device))
        if program is None:
            program = _grad_program(spec, strategy._worker_strategy(device))
            program = _PROGRAMS.setdefault((token, device), program)
        batch, mask, rest = jax.device_put((batch, mask, template), device)
        params = params_tree.read(device)
        stats = stats_tree.read(device) if stats_tree is not None else None
        state = rest.replace(params=params, batch_stats=stats, step=step_index)
        grads, sums, new_stats = program(state, batch, mask)
        params_tree.apply_gradients(grads)
        if stats_tree is not None:
            # Last writer wins, as unsynchronized BatchNorm statistics do in TF.
            stats_tree.assign(new_stats)
        return sums

    return step


def train_model_epoch(
    strategy: Any, model: Any, data: Any, cbs: Any, steps_per_epoch: int | None
) -> dict[str, float] | None:
    """One epoch of `model.fit` on the workers; returns the epoch's mean loss and metrics.

    Returns None (and stops training) when the data gave no batches, as the model does.

    Raises:
      ValueError: if `steps_per_epoch` is None.
    """
    if steps_per_epoch is None:
        raise ValueError(
            "Model.fit with ParameterServerStrategy needs `steps_per_epoch`, as in TF: the "
            "workers train asynchronously, so an epoch is a number of scheduled steps. Pass "
            "e.g. fit(x, y, epochs=..., steps_per_epoch=100)."
        )
    if (
        isinstance(steps_per_epoch, bool)
        or not isinstance(steps_per_epoch, (int, np.integer))
        or steps_per_epoch < 1
    ):
        raise ValueError(f"`steps_per_epoch` must be a positive int; got {steps_per_epoch!r}.")
    spec = model._compiled_spec
    session = _session(strategy, model)
    coordinator = session.coordinator
    state = model._state
    # What the workers need of the state besides the variables (the dropout key, ...).
    template = state.replace(opt_state=None, params=None, batch_stats=None)
    step_fn = _step_fn(strategy, spec, session, template)

    epoch_seed = (model._seed, model._epochs_run)
    model._epochs_run += 1
    results: list[Any] = []
    finished = 0
    running: dict[str, float] = {}
    step = 0
    names = spec.names
    for execution in data.train_executions(epoch_seed, 1, steps_per_epoch):
        cbs.on_train_batch_begin(step)
        index = np.int32(session.step + step)
        results.append(coordinator.schedule(step_fn, args=(execution.batch, execution.mask, index)))
        step += 1
        # Batch logs: the running means of the steps that have finished so far.
        while finished < len(results) and results[finished].done():
            _accumulate(running, results[finished].fetch())
            finished += 1
        cbs.on_train_batch_end(step - 1, _means(running, names))
        if model.stop_training:
            break
    coordinator.join()
    if not step:
        # As `Model._train_epoch`: the data ran out, so training stops.
        model.stop_training = True
        return None
    for rv in results[finished:]:
        _accumulate(running, rv.fetch())
    session.step += step
    new_params = steps_lib.place_state(session.params.read(), strategy)
    new_stats = None
    if session.batch_stats is not None:
        new_stats = steps_lib.place_state(session.batch_stats.read(), strategy)
    model._state = state.replace(
        params=new_params,
        batch_stats=new_stats,
        step=jax.device_put(jnp.asarray(session.step, jnp.int32), strategy.devices[0]),
    )
    session.synced_params = new_params
    return _means(running, names)


def _accumulate(running: dict[str, float], sums: dict[str, Any]) -> None:
    for key, value in sums.items():
        running[key] = running.get(key, 0.0) + float(value)


def _means(running: dict[str, float], names: Any) -> dict[str, float]:
    if not running:
        return {}
    denom = max(running.get(_COUNT, 0.0), 1.0)
    return {name: running[name] / denom for name in names if name in running}
