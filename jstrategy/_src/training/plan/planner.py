"""`plan`: the train step compiled for the strategy's mesh from shapes alone.

The train state is never created: its shapes come from `jax.eval_shape` of the same
creation `create_train_state` runs (or, for a `jstrategy.Model`, of the model's own
state and compiled optimizer), each leaf gets the strategy's
``variable_sharding(leaf, path)``, and the step the factory or `fit` would run
(`body.build_train_program`) is lowered from `jax.ShapeDtypeStruct` inputs and compiled.
So the figures are those of the program a run would execute, on any model size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jstrategy._src import hlo
from jstrategy._src.placement import HOST_MEMORY_KINDS
from jstrategy._src.placement import variable_shardings
from jstrategy._src.precision import policy as mp
from jstrategy._src.strategy import Strategy
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training import input_checks
from jstrategy._src.training.model import Model
from jstrategy._src.training.optimizers.serialization import resolve_optimizer
from jstrategy._src.training.plan.refusal import CompilerRefusal
from jstrategy._src.training.plan.refusal import compiler_refusal
from jstrategy._src.training.plan.report import MemoryPlan
from jstrategy._src.training.plan.report import Remat
from jstrategy._src.training.plan.report import advise
from jstrategy._src.training.plan.search import largest_batch
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.train_state import train_state_shapes
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.training.step import remat as remat_lib

__all__ = ["compiled_peak", "plan"]


def compiled_peak(compiled: Any) -> int:
    """A compiled program's peak per device from XLA's memory analysis: arguments +
    temporaries + outputs - aliased (donated) bytes, in device memory (state offloaded to
    host memory left out: `hlo.device_memory_peak`)."""
    return hlo.device_memory_peak(compiled)


def plan(
    model: Any,
    strategy: Strategy | None = None,
    batch: Any = None,
    *,
    optimizer: Any = None,
    loss: Any = None,
    device_memory: int | None = None,
    dtype_policy: mp.Policy | str | None = None,
    gradient_accumulation_steps: int = 1,
    remat: Any = None,
    sync_batch_norm: BatchNormSync | str = BatchNormSync.GLOBAL,
    train_arg: str | None = "auto",
    find_largest_batch: bool = True,
) -> MemoryPlan:
    """Whether a train step fits the devices, from its compiled program, before any run.

    Traces and compiles the train step for the strategy's mesh without creating the
    state: the state's shapes from `jax.eval_shape`, inputs as `jax.ShapeDtypeStruct` values
    carrying the strategy's shardings (``variable_sharding(leaf, path)`` for the state,
    ``batch_sharding()`` for the batch), then ``.lower(...).compile()`` of the program the
    factory or `fit` runs. Reads per device: parameters, optimizer state, gradients,
    activations and temporaries, the compiled peak (``memory_analysis()``: arguments +
    temporaries + outputs - aliased), the largest global batch that fits
    `device_memory` (the peak is nearly affine in the batch: compiled at two sizes, then
    at the sizes the line through them predicts, every one a multiple of
    ``strategy.batch_multiple``; where the peak is not monotone the search goes on past
    the fall and the plan says the answer is a lower bound: `search.largest_batch`), and,
    when the step does not fit, what to change, only what this model and strategy can
    take: FSDP (more of it where it spans fewer devices than there are; more devices
    where it spans them all) or ``offload_optimizer=True`` when the state dominates;
    remat (for a model that can take ``remat=True``: not a `Sequential` none of whose
    layers calls `jstrategy.training.remat`), microbatches
    (``gradient_accumulation_steps``) or a smaller batch when the activations do.

    Limits: the figures are XLA's for the platform of the strategy's devices (the CPU
    compiler's on fake CPU devices; a GPU's or TPU's differ, their ratios carry over).
    The strategy's mesh is the one compiled for: for a mesh this process does not have,
    build the strategy over `jstrategy.experimental.topology_devices` (a TPU topology's
    compile-only devices, e.g. ``FSDPStrategy(devices=topology_devices("v5e:16x16"))`` or
    ``TPUStrategy(devices=...)``, and a `Model` created in its scope; it needs libtpu
    installed, no TPU). JAX 0.12 has no such topologies for CPU or GPU
    (`topology_devices` says so, with the fix): to plan for N CPU devices, run the plan in
    a process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``. For `CentralStorageStrategy`
    the figures are the replicas' gradient program's (the update runs on the host copy).
    A `fit` with ``steps_per_execution`` > 1 stacks that many batches in its inputs. The
    batch is planned split by rows, as `fit`, distributed datasets and `distribute_batch`
    place it; a NumPy batch handed to a `make_train_step` step under FSDP or
    ModelParallel reaches every device whole, and its program may peak higher.

    Args:
      model: a compiled `jstrategy.Model` (or `Sequential`): its module, optimizer, loss,
        precision policy and step options; or a `flax.linen.Module` with `optimizer` and
        `loss`, as `create_train_state` and `make_train_step` take them.
      strategy: the strategy; None means the model's (a `Model`) or
        `jstrategy.get_strategy()`.
      batch: the global batch ``(x, y)`` or ``(x, y, sample_weight)`` (arrays or
        `jax.ShapeDtypeStruct` values; only shapes and dtypes are read; every leaf's first
        dimension is the batch).
      optimizer: for a linen module: an optax transformation, a `jstrategy.optimizers`
        object or a Keras name; None with a `Model` (its compiled one).
      loss: for a linen module: as `make_train_step`'s; None with a `Model`.
      device_memory: bytes per device to fit; None reads the device's
        ``memory_stats()["bytes_limit"]``, which CPU devices do not report (then give it).
      dtype_policy: for a linen module: as `make_train_step`'s.
      gradient_accumulation_steps: for a linen module: as `make_train_step`'s.
      remat: for a linen module: as `make_train_step`'s.
      sync_batch_norm: for a linen module: as `make_train_step`'s.
      train_arg: for a linen module: as `create_train_state`'s.
      find_largest_batch: False skips the search for the largest batch (up to nine
        more compiles; the answer is a size compiled and verified to fit, within one
        ``batch_multiple`` or 1/32 of the largest, or else labelled a lower bound:
        `MemoryPlan.largest_batch_caveat`).

    A step the compiler refuses for memory (the TPU compiler checks the chip's HBM as it
    compiles, on a topology's compile-only devices too: ``RESOURCE_EXHAUSTED:
    CompileTimeHbmOom``) is planned as not fitting, never raised: the plan's peak is the
    compiler's figure, its budget at most the chip's as the compiler gave it
    (`MemoryPlan.compiler_refusal`), and the advice follows from the state's shapes; the
    batch search counts each size the compiler refuses as not fitting.

    Returns:
      A `MemoryPlan`; ``print(plan)`` shows its table.

    Raises:
      ValueError: for a `Model` not compiled, step options given beside a `Model`, a
        missing `optimizer` or `loss` for a module, a batch whose rows do not divide by
        ``strategy.batch_multiple``, inputs whose rows are not the shape a `Model` was
        declared (``input_shape``) or built for (`fit`'s message), or no `device_memory`
        where the device reports none.
      TypeError: for a model that is neither.

    Example:

    >>> import jax, numpy as np, optax, flax.linen as nn
    >>> import jstrategy
    >>> from jstrategy.experimental import plan
    >>> strategy = jstrategy.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    >>> x = jax.ShapeDtypeStruct((64, 256), np.float32)
    >>> y = jax.ShapeDtypeStruct((64,), np.int32)
    >>> p = plan(nn.Dense(10), strategy, (x, y), optimizer=optax.adam(1e-3),
    ...          loss="sparse_categorical_crossentropy", device_memory=2**20,
    ...          find_largest_batch=False)
    >>> p.fits, p.parameters == (256 * 10 + 10) * 4, p.optimizer_state >= 2 * p.parameters
    (True, True, True)
    """
    options = {
        "optimizer": optimizer,
        "loss": loss,
        "dtype_policy": dtype_policy,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "remat": remat,
        "sync_batch_norm": sync_batch_norm,
        "train_arg": train_arg,
    }
    if isinstance(model, Model):
        build, spec = _from_model(model, strategy, batch, options)
    elif hasattr(model, "init") and hasattr(model, "apply"):
        strategy = strategy if strategy is not None else get_strategy()
        build, spec = _from_module(model, strategy, batch, **options)
    else:
        raise TypeError(
            f"`model` must be a compiled jstrategy.Model (or Sequential) or a "
            f"flax.linen.Module; got {type(model).__name__}. For an NNX module, wrap it: "
            "jstrategy.Model(module), then compile it."
        )
    strategy = spec.strategy
    rows = _batch_rows(batch, strategy)
    budget = _device_memory(device_memory, strategy)
    state = _abstract_state(build(), strategy)
    program = step_lib.build_train_program(spec)

    def compile_at(b: int) -> Any:
        """The step compiled at `b` rows, or the compiler's refusal of it for memory (the
        TPU compiler checks the chip's as it compiles)."""
        try:
            return program.lower(state, None, *_abstract_batch(batch, b, strategy)).compile()
        except jax.errors.JaxRuntimeError as e:
            refusal = compiler_refusal(e)
            if refusal is None:
                raise
            return refusal

    tried: list[tuple[int, int]] = []  # each batch compiled and its peak, in order

    def peak_at(b: int) -> tuple[int, Any]:
        compiled = compile_at(b)
        if isinstance(compiled, CompilerRefusal):
            peak = _refused_peak(compiled, budget)
        else:
            peak = compiled_peak(compiled)
        tried.append((b, peak))
        return peak, compiled

    compiled = compile_at(rows)
    refusal = compiled if isinstance(compiled, CompilerRefusal) else None
    if refusal is not None:
        if refusal.available is not None:
            # The compiler's budget is the chip's: the verdict and the search use it.
            budget = min(budget, refusal.available)
        peak = _refused_peak(refusal, budget)
    else:
        peak = compiled_peak(compiled)
    tried.append((rows, peak))
    figures = _figures(state, compiled, peak, _abstract_batch(batch, rows, strategy)[0])
    largest, caveat = None, ""
    if find_largest_batch:
        # The state and its gradients stay whatever the batch: the second size's guess.
        fixed = sum(figures[k] for k in ("parameters", "optimizer_state", "other_state"))
        largest, caveat = largest_batch(
            peak_at, rows, peak, budget, strategy.batch_multiple, fixed + figures["gradients"]
        )
    found = MemoryPlan(
        strategy=repr(strategy),
        devices=strategy.mesh.size,
        batch_size=rows,
        peak=peak,
        device_memory=budget,
        largest_batch=largest,
        searched=find_largest_batch,
        largest_batch_caveat=caveat,
        advice=(),
        compiler_refusal=refusal,
        batch_peaks=tuple(tried),
        **figures,
    )
    if found.fits:
        return found
    module = model.module if isinstance(model, Model) else model
    advice = advise(
        found,
        split=_split(state.params),
        device_count=_device_count(strategy),
        remat=_remat(
            module, spec, lambda s: s.lower(state, None, *_abstract_batch(batch, rows, strategy))
        ),
        accumulation_steps=spec.accumulation_steps,
        multiple=strategy.batch_multiple,
        pipeline=strategy.pipeline,
    )
    return dataclasses.replace(found, advice=advice)


# What a linen module's plan takes beside it, at their defaults: a `Model` has its own.
_MODULE_OPTIONS = {
    "optimizer": None,
    "loss": None,
    "dtype_policy": None,
    "gradient_accumulation_steps": 1,
    "remat": None,
    "sync_batch_norm": BatchNormSync.GLOBAL.value,
    "train_arg": "auto",
}


def _from_model(
    model: Model, strategy: Strategy | None, batch: Any, options: dict[str, Any]
) -> tuple[Callable[[], Any], step_lib.StepSpec]:
    given = sorted(
        name
        for name, value in options.items()
        if getattr(value, "value", value) != _MODULE_OPTIONS[name]
    )
    if given:
        raise ValueError(
            f"{given} cannot be given with a jstrategy.Model: its compiled optimizer, loss "
            "and step options are planned. Pass them to model.compile(...) instead, then "
            "plan(model, batch=...)."
        )
    if strategy is not None and strategy is not model.strategy:
        raise ValueError(
            f"The model was created under {model.strategy!r}, but `strategy` is "
            f"{strategy!r}. A model trains where it was created; pass strategy=None (or "
            "its own), or create the model inside the other strategy's scope."
        )
    trainer = model._trainer
    spec = trainer.spec
    if spec is None:
        raise ValueError(
            "The model is not compiled, so there is no train step to plan. Call "
            "model.compile(optimizer, loss, ...) first."
        )
    tx = trainer._raw_tx  # set by compile
    x = _first_leaf_rows(batch)
    # The rows fit takes: a batch of another shape would plan another model.
    input_checks.check_row_shape(model._input_shape, x, "batch")

    def build() -> Any:
        state = trainer.state
        if state is None:  # not built yet: the module's state from one row's shapes
            sample = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), x)
            return train_state_shapes(
                model.module,
                tx,
                sample,
                rng=trainer.seed,
                strategy=model.strategy,
                train_arg=model._train_arg,
                dtype_policy=trainer.policy,
            )
        if trainer._tx is None:  # compiled, the optimizer state not made yet
            return jax.eval_shape(lambda s: s.with_optimizer(tx), state)
        return jax.eval_shape(lambda s: s, state)

    return lambda: jax.eval_shape(lambda s: step_lib.prepare_state(spec, s), build()), spec


def _from_module(
    module: Any,
    strategy: Strategy,
    batch: Any,
    *,
    optimizer: Any,
    loss: Any,
    dtype_policy: Any,
    gradient_accumulation_steps: int,
    remat: Any,
    sync_batch_norm: Any,
    train_arg: str | None,
) -> tuple[Callable[[], Any], step_lib.StepSpec]:
    if optimizer is None or loss is None:
        missing = [n for n, v in (("optimizer", optimizer), ("loss", loss)) if v is None]
        raise ValueError(
            f"Planning a module's train step needs {' and '.join(missing)}: pass them as "
            "create_train_state and make_train_step take them, e.g. "
            "plan(module, strategy, batch, optimizer=optax.adam(1e-3), loss='mse')."
        )
    _, tx = resolve_optimizer(optimizer)
    spec = step_lib.make_spec(
        loss,
        None,
        strategy,
        dtype_policy=dtype_policy,
        gradient_accumulation_steps=gradient_accumulation_steps,
        sync_batch_norm=sync_batch_norm,
        remat=remat,
    )
    x = _first_leaf_rows(batch)
    sample = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), x)

    def build() -> Any:
        state = train_state_shapes(
            module,
            tx,
            sample,
            strategy=strategy,
            train_arg=train_arg,
            dtype_policy=spec.policy,
        )
        return jax.eval_shape(lambda s: step_lib.prepare_state(spec, s), state)

    return build, spec


def _first_leaf_rows(batch: Any) -> Any:
    """The batch's inputs ``x`` (as shapes)."""
    if not isinstance(batch, (tuple, list)) or not 2 <= len(batch) <= 3:
        raise ValueError(
            f"`batch` must be the global batch (x, y) or (x, y, sample_weight) of arrays or "
            f"jax.ShapeDtypeStructs; got {type(batch).__name__}. Pass e.g. "
            "(jax.ShapeDtypeStruct((256, 784), 'float32'), jax.ShapeDtypeStruct((256,), "
            "'int32'))."
        )
    return jax.tree.map(_shape_of, batch[0])


def _shape_of(a: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        a = np.asarray(a)
    return jax.ShapeDtypeStruct(tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype))


def _batch_rows(batch: Any, strategy: Strategy) -> int:
    _first_leaf_rows(batch)
    leaves = [_shape_of(a) for a in jax.tree.leaves(batch)]
    sizes = {a.shape[0] if a.shape else -1 for a in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"Every leaf of `batch` must have the batch as its first dimension, the same in "
            f"all; got first dimensions {sorted(map(str, sizes))}. Pass the global batch "
            "(x, y) with one row per example."
        )
    rows = sizes.pop()
    multiple = strategy.batch_multiple
    if rows < 1 or rows % multiple:
        raise ValueError(
            f"`batch` has {rows} rows; under {strategy!r} a global batch divides by "
            f"{multiple} (strategy.batch_multiple). Pass e.g. "
            f"{max(multiple, rows - rows % multiple)} rows."
        )
    return rows


def _abstract_batch(batch: Any, rows: int, strategy: Strategy) -> tuple[Any, Any]:
    """The batch at `rows` rows, as shapes split like a real batch, and its row mask: None,
    the full batch's, as `fit` runs a batch without padding (`body.row_weights`)."""
    sharding = strategy.batch_sharding()

    def at(a: Any) -> jax.ShapeDtypeStruct:
        a = _shape_of(a)
        return jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype, sharding=sharding)

    values = tuple(jax.tree.map(at, part) for part in batch)
    return values, None


def _device_memory(device_memory: int | None, strategy: Strategy) -> int:
    if device_memory is not None:
        if isinstance(device_memory, bool) or not isinstance(device_memory, (int, np.integer)):
            raise TypeError(
                f"`device_memory` must be an int of bytes per device, e.g. 16 * 2**30; got "
                f"{type(device_memory).__name__} {device_memory!r}."
            )
        if device_memory <= 0:
            raise ValueError(
                f"`device_memory` must be a positive number of bytes per device; got "
                f"{device_memory}. Pass e.g. device_memory=16 * 2**30."
            )
        return int(device_memory)
    device = strategy.local_devices[0]
    try:
        stats = device.memory_stats()
    except Exception:  # a compile-only device (`topology_devices`) has no memory to ask
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    raise ValueError(
        f"`device_memory` is needed: {device.platform} device {device} reports no memory "
        "limit (memory_stats()). Pass the bytes one device has, e.g. "
        "device_memory=16 * 2**30 for a 16 GiB accelerator."
    )


def _abstract_state(shapes: Any, strategy: Strategy) -> Any:
    """The state's shapes carrying the strategy's shardings (as a placed state would)."""
    shardings = variable_shardings(shapes, strategy)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def _bytes(tree: Any) -> tuple[int, int]:
    """``(device, host)`` bytes of abstract sharded leaves on one device."""
    device = host = 0
    for leaf in jax.tree.leaves(tree):
        n = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        if leaf.sharding.memory_kind in HOST_MEMORY_KINDS:
            host += n
        else:
            device += n
    return device, host


def _refused_peak(refusal: CompilerRefusal, budget: int) -> int:
    """The peak of a step the compiler refused: its figure, and over `budget` whatever
    that says (a refused step never fits)."""
    return max(refusal.required or 0, budget + 1)


def _figures(state: Any, compiled: Any, peak: int, batch: Any) -> dict[str, int]:
    """The plan's figures from the state's shapes and the compiled program; from the shapes
    alone where the compiler refused it (`compiled` a `CompilerRefusal`: its figure is the
    peak)."""
    params = _bytes(state.params)[0]
    opt = _bytes(state.opt_state)[0]
    total, total_host = _bytes(state)
    # A gradient per parameter at its parameter's layout; a parameter kept in host memory
    # (CentralStorage) has its gradient computed whole on each replica.
    gradients = sum(
        math.prod(
            leaf.shape
            if leaf.sharding.memory_kind in HOST_MEMORY_KINDS
            else leaf.sharding.shard_shape(leaf.shape)
        )
        * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state.params)
    )
    if isinstance(compiled, CompilerRefusal):
        inputs = _bytes(batch)[0]
        arguments = total + inputs
        in_host_memory = True  # no program to say otherwise: the strategy's layout
    else:
        arguments = hlo.device_arguments_bytes(compiled)
        inputs = max(0, arguments - total)
        in_host_memory = arguments < compiled.memory_analysis().argument_size_in_bytes
    if total_host and not in_host_memory:
        # CentralStorage: the gradient program takes the host copy whole on each replica
        # (an offloading strategy's program takes its host leaves in host memory).
        inputs = max(0, arguments - total - total_host)
    # XLA may hold fewer (a gradient fused into its update): the figures add up to the peak.
    gradients = min(gradients, max(0, peak - arguments))
    return {
        "parameters": params,
        "optimizer_state": opt,
        "other_state": total - params - opt,
        "gradients": gradients,
        "inputs": inputs,
        "activations": max(0, peak - arguments - gradients),
        "host": total_host,
    }


def _split(params: Any) -> int:
    """The most ways one parameter is split over the devices (1: whole on each)."""
    return max(
        (
            math.prod(leaf.shape) // max(1, math.prod(leaf.sharding.shard_shape(leaf.shape)))
            for leaf in jax.tree.leaves(params)
        ),
        default=1,
    )


def _device_count(strategy: Strategy) -> int:
    """The devices a strategy could split the variables over: those of its platform this
    process sees (every process's), or its mesh's where that has more (compile-only
    devices of a topology)."""
    mesh = strategy.mesh
    first = mesh.devices.flat[0]
    try:
        seen = jax.devices(first.platform)
    except RuntimeError:  # no backend for a topology's platform
        return int(mesh.size)
    return max(int(mesh.size), len(seen)) if first in seen else int(mesh.size)


def _remat(module: Any, spec: step_lib.StepSpec, lower: Callable[[Any], Any]) -> Remat:
    """Whether the step can take ``remat=True`` (`report.advise`'s ``remat``). A library's
    module (a `Sequential`'s, Flax's) takes it only where one of its layers calls
    `jstrategy.training.remat`: the step is traced with it to see (`lower` traces a
    program); the user's own module can wrap its repeated block."""
    if spec.remat is not None:
        return "on"
    if not type(module).__module__.startswith(("jstrategy.", "flax.")):
        return "wrap"
    with_remat = dataclasses.replace(spec, remat=remat_lib.resolve_remat(True))
    try:
        lower(step_lib.build_train_program(with_remat))
    except remat_lib.RematUnusedError:
        return "no"
    return "ready"
