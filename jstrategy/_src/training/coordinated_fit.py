"""`jstrategy.Model.fit` through a `ClusterCoordinator`: asynchronous epochs on the workers.

A `Trainer` whose strategy says ``should_use_with_coordinator`` (`ParameterServerStrategy`,
as TF's Keras checks ``strategy._should_use_with_coordinator``) owns a
`CoordinatedFitRunner`, which runs each epoch of `fit` here. As Keras with TF's strategy,
`steps_per_epoch` is required. The model's trained variables
and its other mutable variables (BatchNorm statistics, NNX random-stream counts) are
`VariableTree` objects on the parameter servers, created at the first epoch with the compiled
optimizer (run per variable there) and kept by the runner across epochs and `fit` calls. The coordinator
cuts the epoch's batches as the model does for any strategy and schedules one step per
batch; each worker pulls the current variables, computes the gradient of the mean loss
over the batch's real rows on its device with the one step body
(`step.replica_gradients`, in one compiled program), and pushes it. At the end of the
epoch the coordinator waits for every step and returns the train state with the
parameter servers' variables, so `evaluate`, `predict` and callbacks see them.

Linen and NNX train states alike, through `TrainStateProtocol`: the runner only swaps a
state's variables and step. Typed PRNG keys (NNX's random streams) never change in a step,
so they stay with the workers' copy of the state rather than on the parameter servers.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jstrategy._src.numerics import host_means
from jstrategy._src.parameter_server import backend as backend_lib
from jstrategy._src.parameter_server.coordinator import ClusterCoordinator
from jstrategy._src.parameter_server.strategy import ParameterServerStrategy
from jstrategy._src.placement import place_state
from jstrategy._src.staging import replica_map
from jstrategy._src.staging import row_spec
from jstrategy._src.strategy import Strategy
from jstrategy._src.training.fit_runner import FitEpoch
from jstrategy._src.training.fit_runner import FitEpochResult
from jstrategy._src.training.fit_runner import FitRunner
from jstrategy._src.training.optimizers import learning_rate as learning_rate_lib
from jstrategy._src.training.optimizers.base import injected_state
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.validation import check_positive_int
from jstrategy._src.values import is_key
from jstrategy._src.values import local_copy

__all__ = ["CoordinatedFitRunner"]


@dataclasses.dataclass(frozen=True)
class _Mutable:
    """A model state's leaves: typed keys stay with the workers, the rest go to the servers."""

    treedef: Any
    keys: tuple[tuple[int, Any], ...]  # (leaf index, key array)

    @classmethod
    def of(cls, tree: Any) -> _Mutable:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple((i, x) for i, x in enumerate(leaves) if is_key(x)))

    def values(self, tree: Any) -> list[Any]:
        """The leaves that live on the parameter servers."""
        positions = {i for i, _ in self.keys}
        return [x for i, x in enumerate(jax.tree.leaves(tree)) if i not in positions]

    def merge(self, keys: Any, values: list[Any]) -> Any:
        """The model state from `keys` (like `self.keys`' arrays) and the servers' values."""
        by_index = dict(zip([i for i, _ in self.keys], keys, strict=True))
        rest = iter(values)
        leaves = [
            by_index[i] if i in by_index else next(rest) for i in range(self.treedef.num_leaves)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass
class _Session:
    """What a model keeps on a cluster between epochs."""

    coordinator: Any
    params: Any  # VariableTree of the parameters, with the optimizer
    mutable: Any  # VariableTree of the model state's values (a list), or None
    layout: _Mutable
    synced_params: Any  # the model's params object the variables were last copied into
    step: int
    tx: Any  # the optimizer the variables were created with
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # The learning rate last set in the variables' optimizer states (None: never set).
    rate: float | None = None


# Compiled gradient programs by (session token, device), in whichever process runs them.
_PROGRAMS: dict[Any, Any] = {}


def _gradients_program(spec: step_lib.StepSpec, worker_strategy: Strategy) -> Any:
    """``(params, rest, batch, mask) -> (grads, model_state, sums)`` on one worker's device:
    the step body's gradients, without the update (the parameter servers apply it)."""
    worker_spec = dataclasses.replace(spec, strategy=worker_strategy)

    def gradients(params: Any, rest: Any, batch: Any, mask: Any) -> Any:
        return step_lib.replica_gradients(worker_spec, params, rest, batch, mask)

    rows = row_spec(worker_strategy)
    return jax.jit(
        replica_map(
            worker_strategy, gradients, in_specs=(P(), P(), rows, rows), out_specs=(P(), P(), P())
        )
    )


def _session(strategy: ParameterServerStrategy, session: _Session | None, state: Any) -> _Session:
    """The session for `state`: `session` (the runner's, or None) when it holds `state`'s
    variables, or with `state`'s values assigned, or a new one."""
    if session is not None and session.synced_params is state.params:
        return session
    layout = _Mutable.of(state.model_state)
    if (
        session is not None
        and session.tx is state.tx
        and session.layout.treedef == layout.treedef
        and [i for i, _ in session.layout.keys] == [i for i, _ in layout.keys]
        and jax.tree.structure(session.synced_params) == jax.tree.structure(state.params)  # type: ignore[operator]
    ):
        # New values for the same variables (load_weights, a restore): assigned in place,
        # so the parameter servers hold one set of variables per model. Their optimizer
        # states stay, as Keras's load_weights leaves the optimizer's.
        session.params.assign(jax.device_get(state.params))
        if session.mutable is not None:
            session.mutable.assign(jax.device_get(layout.values(state.model_state)))
        session.layout = layout
        session.synced_params = state.params
        session.step = int(np.asarray(local_copy(state.step)))
        return session
    params = strategy.create_variables(jax.device_get(state.params), optimizer=state.tx)
    values = layout.values(state.model_state)
    mutable = strategy.create_variables(jax.device_get(values)) if values else None
    return _Session(
        coordinator=ClusterCoordinator(strategy),
        params=params,
        mutable=mutable,
        layout=layout,
        synced_params=state.params,
        step=int(state.step),
        tx=state.tx,
    )


def _step_fn(strategy: ParameterServerStrategy, spec: Any, session: _Session, template: Any):
    """The function scheduled for each batch: pull, compute, push; returns the sums."""
    params_tree = session.params
    mutable_tree = session.mutable
    layout = session.layout
    keys = [k for _, k in layout.keys]
    token = session.token

    def step(batch: Any, mask: Any, step_index: Any) -> Any:
        worker = backend_lib.current_worker()
        device = worker.device if worker is not None else strategy.devices[0]
        # Cached by module, not in the closure: with Ray the closure arrives anew each step.
        program = _PROGRAMS.get((token, device))
        if program is None:
            program = _gradients_program(spec, strategy.worker_strategy(device))
            program = _PROGRAMS.setdefault((token, device), program)
        batch, mask, rest, local_keys = jax.device_put((batch, mask, template, keys), device)
        params = params_tree.read(device)
        model_state = None
        if layout.treedef.num_leaves:
            values = mutable_tree.read(device) if mutable_tree is not None else []
            model_state = layout.merge(local_keys, values)
        rest = rest.with_variables(None, model_state).with_step(step_index)
        grads, new_model_state, sums = program(params, rest, batch, mask)
        params_tree.apply_gradients(grads)
        if mutable_tree is not None:
            # Last writer wins, as unsynchronized BatchNorm statistics do in TF.
            mutable_tree.assign(layout.values(new_model_state))
        return sums

    return step


class CoordinatedFitRunner(FitRunner):
    """`Model.fit` on a `ParameterServerStrategy`'s workers, through a `ClusterCoordinator`.

    Each epoch schedules one step per batch on the workers; each pulls the variables,
    computes its gradients and pushes them to the parameter servers. The runner keeps the
    model's variables there (with the optimizer) across epochs and `fit` calls.

    Args:
      strategy: the model's strategy, one whose ``should_use_with_coordinator`` is True.

    Raises:
      TypeError: if `strategy` is not a `ParameterServerStrategy`.
    """

    #: False: the workers train asynchronously, so `BackupAndRestore` backs up between
    #: epochs only (a resumed job restarts the interrupted epoch).
    resumes_exactly = False

    def __init__(self, strategy: Strategy):
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                "CoordinatedFitRunner trains through a ClusterCoordinator, which needs a "
                f"jstrategy.experimental.ParameterServerStrategy; got {strategy!r}. Use the "
                "default FitRunner for this strategy."
            )
        self._strategy = strategy
        self._session: _Session | None = None

    def _sync(self, state: Any) -> _Session:
        self._session = _session(self._strategy, self._session, state)
        return self._session

    def run_epoch(self, epoch: FitEpoch) -> FitEpochResult | None:
        """One epoch of `Model.fit` on the workers: the new state and the epoch's mean logs.

        Returns None (training stops) when the data gave no batches, as the default runner.

        Raises:
          ValueError: if `steps_per_epoch` is None or not a positive int.
        """
        return _run_epoch(self._strategy, self._sync, epoch)

    def backup_state(self, state: Any) -> Any:
        """Each variable's optimizer state on the parameter servers (sharded variables: one
        per shard)."""
        return {"opt_state": self._sync(state).params.opt_state()}

    def restore_backup_state(self, state: Any, saved: Any) -> None:
        """Puts a restored backup on the parameter servers: the train state's variables, and
        each variable's optimizer state."""
        session = self._sync(state)
        session.params.assign(jax.device_get(state.params))
        if session.mutable is not None:
            session.mutable.assign(jax.device_get(session.layout.values(state.model_state)))
        session.params.assign_opt_state(saved["opt_state"])
        session.synced_params = state.params
        session.step = int(np.asarray(local_copy(state.step)))
        session.rate = None


def _run_epoch(
    strategy: ParameterServerStrategy, sync: Callable[[Any], _Session], epoch: FitEpoch
) -> FitEpochResult | None:
    """`CoordinatedFitRunner.run_epoch`; `sync(state)` gives the session holding `state`'s
    variables (called once the epoch's options are checked: it may create them)."""
    steps_per_epoch = epoch.steps_per_epoch
    if steps_per_epoch is None:
        raise ValueError(
            "Model.fit with ParameterServerStrategy needs `steps_per_epoch`, as in TF: the "
            "workers train asynchronously, so an epoch is a number of scheduled steps. Pass "
            "e.g. fit(x, y, epochs=..., steps_per_epoch=100)."
        )
    steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch")
    spec, state, cbs = epoch.programs.spec, epoch.state, epoch.callbacks
    _check_synchronous_options(spec, state)
    session = sync(state)
    _sync_rate(session, state)
    epoch.begin()
    coordinator = session.coordinator
    # What the workers need of the state besides the variables (the dropout key, ...).
    template = state.replica_view().with_variables(None, None)
    step_fn = _step_fn(strategy, spec, session, template)

    epoch_seed = epoch.trainer.next_order_seed()
    results: list[Any] = []
    finished = 0
    running: dict[str, float] = {}
    step = 0
    names = spec.names
    for execution in epoch.data.train_executions(epoch_seed, 1, steps_per_epoch):
        cbs.on_train_batch_begin(step)
        index = np.int32(session.step + step)
        results.append(coordinator.schedule(step_fn, args=(execution.batch, execution.mask, index)))
        step += 1
        # Batch logs: the running means of the steps that have finished so far.
        while finished < len(results) and results[finished].done():
            _accumulate(running, results[finished].fetch())
            finished += 1
        cbs.on_train_batch_end(step - 1, host_means(running, names))
        if epoch.stop_requested:
            break
    # Each wait is bounded from the previous step's end (a slow epoch is fine, a worker
    # that stops answering is not); join then raises what a step raised.
    timeout = strategy.timeout_seconds
    for rv in results[finished:]:
        try:
            _accumulate(running, rv.fetch(timeout))
        except TimeoutError as e:
            raise TimeoutError(
                f"Model.fit: no step of the epoch finished within {timeout:g} s ({e}). "
                "Pass ParameterServerStrategy(..., timeout_seconds=...) to allow more time "
                "(None waits without bound)."
            ) from e
    coordinator.join()
    if not step:
        return None
    session.step += step
    model_state = None
    if session.layout.treedef.num_leaves:
        values = session.mutable.read() if session.mutable is not None else []
        model_state = session.layout.merge([k for _, k in session.layout.keys], values)
    new = state.with_variables(session.params.read(), model_state)
    new = _with_update_count(new.with_step(np.int32(session.step)), session.step)
    new = place_state(new, strategy)
    session.synced_params = new.params
    return FitEpochResult(new, running, host_means(running, names))


def _check_synchronous_options(spec: step_lib.StepSpec, state: Any) -> None:
    """Options that need every update to see all gradients of a step: not asynchronous ones."""
    if spec.accumulation_steps > 1:
        raise ValueError(
            f"Model.fit with ParameterServerStrategy takes gradient_accumulation_steps=1; got "
            f"{spec.accumulation_steps}. Each worker's gradients are applied on the parameter "
            "servers as they arrive, so there is no cycle to accumulate over: use a larger "
            "batch, or a synchronous strategy (MirroredStrategy) to accumulate."
        )
    inner = getattr(injected_state(state.opt_state), "inner_state", None)
    if jax.tree.leaves(getattr(inner, "average", None)):
        raise ValueError(
            "Model.fit with ParameterServerStrategy takes no optimizer with use_ema=True: each "
            "variable's optimizer state lives on a parameter server, so the average that "
            "fit's end would copy into the model is not here. Average the weights in a "
            "callback, or train with a synchronous strategy (MirroredStrategy)."
        )
    if state.loss_scale is not None:
        raise ValueError(
            "Model.fit with ParameterServerStrategy has no dynamic loss scaling (policy "
            f"{spec.policy.name!r}): the parameter servers apply each worker's gradients as "
            "they arrive and cannot skip a non-finite step for all of them. Use "
            "dtype_policy='mixed_bfloat16', which needs no loss scale."
        )


def _with_update_count(state: Any, count: int) -> Any:
    """`state` whose learning rate's update count is `count`, the updates the parameter
    servers applied (so a schedule's current rate reads right)."""
    return state.replace(opt_state=learning_rate_lib.with_count(state.opt_state, count))


def _sync_rate(session: _Session, state: Any) -> None:
    """Sets the learning rate of the train state (`Model.learning_rate`, a scheduler) in
    every variable's optimizer state on the parameter servers, when it changed."""
    rate = learning_rate_lib.stored(state.opt_state)
    if rate is None or session.rate == rate:
        return
    session.params.assign_opt_state(learning_rate_lib.fill(session.params.opt_state(), rate))
    session.rate = rate


def _accumulate(running: dict[str, float], sums: dict[str, Any]) -> None:
    for key, value in sums.items():
        running[key] = running.get(key, 0.0) + float(value)
