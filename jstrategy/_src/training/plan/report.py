"""What `plan` found: the per-device figures, whether the step fits, and what to change.

A frozen record (`MemoryPlan`) whose ``str`` is the table a user prints, and the advice
(`Fix`, `Advice`) derived from its figures alone, so the rules read in one place.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING
from typing import Literal

from jstrategy._src.training.plan.refusal import CompilerRefusal

if TYPE_CHECKING:
    from jstrategy._src.pipeline.schedules import PipelineConfig

__all__ = ["Advice", "Fix", "MemoryPlan", "Remat", "advise", "format_bytes"]

#: Whether a step can rematerialize (`advise`'s ``remat``).
Remat = Literal["on", "ready", "wrap", "no"]


class Fix(enum.Enum):
    """A change that lowers the train step's peak per device (`MemoryPlan.fixes`).

    Example:

    >>> from jstrategy.experimental import Fix
    >>> Fix("remat"), Fix.OFFLOAD_OPTIMIZER.value
    (<Fix.REMAT: 'remat'>, 'offload_optimizer')
    """

    FSDP = "fsdp"  # split parameters, gradients and optimizer state over the devices
    OFFLOAD_OPTIMIZER = "offload_optimizer"  # optimizer state in host memory
    REMAT = "remat"  # recompute activations in the backward pass
    MICROBATCHES = "microbatches"  # gradient accumulation over smaller batches
    SMALLER_BATCH = "smaller_batch"
    MORE_DEVICES = "more_devices"  # a larger mesh, where the state is split over all of it
    MORE_STAGES = "more_stages"  # a pipeline's layers over more stages
    PIPELINE_MICROBATCHES = "pipeline_microbatches"  # a pipeline's rows in more microbatches
    SCHEDULE = "schedule"  # a pipeline's 1F1B schedule, which keeps fewer microbatches


@dataclasses.dataclass(frozen=True)
class Advice:
    """One change that would make the step fit, and why (`MemoryPlan.advice`).

    Example:

    >>> from jstrategy.experimental import Advice, Fix
    >>> Advice(Fix.REMAT, "remat=True ...").fix
    <Fix.REMAT: 'remat'>
    """

    fix: Fix
    message: str


def format_bytes(n: int | None) -> str:
    """Bytes as a short human figure: ``"1.50 GiB"``, ``"12.0 MiB"``, ``"512 B"``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The train step's memory per device, from its compiled program, before any run.

    Returned by `jstrategy.experimental.plan`; ``print(plan)`` shows it as a table. All
    figures are bytes on the fullest device.

    Attributes:
      strategy: the strategy's ``repr``.
      devices: the devices of the strategy's mesh the step was compiled for.
      batch_size: the global batch (rows) planned for.
      parameters: the trained variables held in device memory.
      optimizer_state: the optimizer's state held in device memory.
      other_state: the rest of the train state in device memory (step count, BatchNorm
        statistics, loss scale, gradient accumulators).
      gradients: one gradient per parameter at its parameter's layout (what the update
        reads), part of the compiled temporaries (no more than they are: XLA may fuse a
        gradient into its update). The figures from `parameters` to `activations` add
        up to `peak`.
      inputs: the batch on the device.
      activations: the rest of the peak: the step's temporaries besides the gradients
        (the forward pass's activations kept for the backward pass, the update's
        temporaries) and outputs not written over the donated state.
      peak: the compiled program's peak: ``memory_analysis()``'s arguments +
        temporaries + outputs - aliased (donated) bytes.
      host: bytes of the train state held in host memory (not in `peak`).
      device_memory: the per-device budget the plan was checked against.
      largest_batch: the largest global batch (a multiple of the strategy's
        ``batch_multiple``) whose step fits `device_memory`, compiled and verified, within
        one ``batch_multiple`` or 1/32 of the largest that fits unless
        `largest_batch_caveat` says otherwise; None when none fits.
      advice: what to change when it does not fit, most effective first (empty when
        it fits).
      searched: whether the largest batch was searched (``find_largest_batch``).
      largest_batch_caveat: empty when `largest_batch` is within that step of the largest
        batch that fits; else why it is only a lower bound (the peak fell as the batch
        grew between two compiled sizes, so a larger batch may fit past them; or the
        search stopped at its compile limit first). `largest_batch_is_lower_bound` says
        whether there is one.
      compiler_refusal: None when the step compiled; else the compiler's refusal for
        memory (the TPU compiler checks the chip's HBM as it compiles, on compile-only
        devices too): the step does not fit, `peak` is the compiler's figure (what it
        said the program needs), `device_memory` at most what it said the chip has, and
        the figures from `parameters` to `inputs` are the state's and the batch's
        shapes' (the rest of the peak is `activations`).
      batch_peaks: each global batch the plan compiled, in order (the batch given first,
        then the search's), with its compiled peak (where the compiler refused it for
        memory, its figure, over `device_memory`): `compiles` and `largest_batch_peak`
        read it.

    Example:

    >>> import jax, optax, flax.linen as nn, jstrategy
    >>> from jstrategy.experimental import plan
    >>> batch = (jax.ShapeDtypeStruct((8, 4), "float32"), jax.ShapeDtypeStruct((8, 1), "float32"))
    >>> p = plan(nn.Dense(1), jstrategy.OneDeviceStrategy("cpu:0"), batch, optimizer="sgd",
    ...          loss="mse", device_memory=2**30, find_largest_batch=False)
    >>> print(p)  # doctest: +ELLIPSIS
    Train step plan: OneDeviceStrategy(...), 1 device(s), global batch 8; per device:
      parameters                           20 B
    ...
      fits (0% of device memory)
      largest global batch that fits: not searched (find_largest_batch=False)
    >>> p.fits, p.advice
    (True, ())
    """

    strategy: str
    devices: int
    batch_size: int
    parameters: int
    optimizer_state: int
    other_state: int
    gradients: int
    inputs: int
    activations: int
    peak: int
    host: int
    device_memory: int
    largest_batch: int | None
    advice: tuple[Advice, ...]
    searched: bool = True
    largest_batch_caveat: str = ""
    compiler_refusal: CompilerRefusal | None = None
    batch_peaks: tuple[tuple[int, int], ...] = ()

    @property
    def compiles(self) -> int:
        """How many times the plan compiled the step (the batch given's, and the search's)."""
        return len(self.batch_peaks)

    @property
    def largest_batch_peak(self) -> int | None:
        """The compiled peak at `largest_batch` (None when none fits or it was not
        searched): the program's ``memory_analysis()`` figure at that batch."""
        return dict(self.batch_peaks).get(self.largest_batch) if self.largest_batch else None

    @property
    def fits(self) -> bool:
        """Whether the step compiled and its peak fits `device_memory`."""
        return self.compiler_refusal is None and self.peak <= self.device_memory

    @property
    def largest_batch_is_lower_bound(self) -> bool:
        """Whether a batch larger than `largest_batch` (by more than one step: a
        ``batch_multiple``, or 1/32 of it) may fit: `largest_batch_caveat` says why."""
        return bool(self.largest_batch_caveat)

    @property
    def fixes(self) -> tuple[Fix, ...]:
        """The kinds of change the advice names, in its order."""
        return tuple(a.fix for a in self.advice)

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("optimizer state", self.optimizer_state),
            ("other state", self.other_state),
            ("gradients", self.gradients),
            ("inputs", self.inputs),
            ("activations and temporaries", self.activations),
            ("compiled peak", self.peak),
            ("device memory", self.device_memory),
        ]
        lines = [
            f"Train step plan: {self.strategy}, {self.devices} device(s), global batch "
            f"{self.batch_size}; per device:"
        ]
        lines += [f"  {name:<29}{format_bytes(n):>12}" for name, n in rows]
        if self.host:
            lines.append(f"  {'(state in host memory)':<29}{format_bytes(self.host):>12}")
        share = self.peak / self.device_memory if self.device_memory else float("inf")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  {verdict} ({share:.0%} of device memory)")
        if self.compiler_refusal is not None:
            lines.append(f"  the compiler refused it: {self.compiler_refusal.message}")
        largest = "none" if self.largest_batch is None else str(self.largest_batch)
        if self.largest_batch_peak is not None:
            largest += f" (compiled peak {format_bytes(self.largest_batch_peak)})"
        if not self.searched:
            largest = "not searched (find_largest_batch=False)"
        elif self.largest_batch_caveat:
            at_least = "none found" if self.largest_batch is None else f"at least {largest}"
            largest = f"{at_least} ({self.largest_batch_caveat})"
        lines.append(f"  largest global batch that fits: {largest}")
        for a in self.advice:
            lines.append(f"  - {a.message}")
        return "\n".join(lines)


def advise(
    plan: MemoryPlan,
    *,
    split: int,
    device_count: int,
    remat: Remat,
    accumulation_steps: int,
    multiple: int,
    pipeline: PipelineConfig | None = None,
) -> tuple[Advice, ...]:
    """What to change when `plan` does not fit, from its figures and what the model and
    strategy can take: nothing that cannot be followed.

    The state (parameters, optimizer state, gradients) against the rest decides the
    order: when it dominates, FSDP and offloading the optimizer state lead; when the
    activations do, remat, microbatches and a smaller batch lead.

    Args:
      plan: the plan (its `advice` is ignored).
      split: the most ways the strategy splits one parameter over its devices (1: every
        device holds whole copies).
      device_count: the devices a strategy could split the variables over: those of the
        strategy's platform this process sees, or the strategy's mesh's where it has
        more (compile-only devices).
      remat: whether the step can rematerialize: ``"on"`` (it does already),
        ``"ready"`` (the model calls `jstrategy.training.remat`: ``remat=True`` works as
        is), ``"wrap"`` (the user's own module, which can wrap its repeated block) or
        ``"no"`` (a library's module, e.g. a `Sequential`'s, that never calls it:
        ``remat=True`` is refused).
      accumulation_steps: the step's ``gradient_accumulation_steps``.
      multiple: what a global batch's rows divide by (``strategy.batch_multiple``).
      pipeline: the strategy's pipeline (``strategy.pipeline``), or None: a pipeline's
        state falls with more stages or with its stages' variables split over their
        replicas, its activations with more microbatches or the 1F1B schedule, not
        with a larger FSDP degree (`_pipeline_advice`).
    """
    if plan.fits:
        return ()
    state = plan.parameters + plan.optimizer_state + plan.gradients
    over = plan.peak - plan.device_memory
    state_advice: list[Advice] = []
    pipeline_batch: list[Advice] = []
    if pipeline is not None:
        state_advice, pipeline_batch = _pipeline_advice(plan, pipeline, split, device_count)
    elif split >= device_count:
        # Split over every device already (or one device): no larger FSDP degree exists.
        state_advice.append(
            Advice(
                Fix.MORE_DEVICES,
                f"More devices: the state ({format_bytes(state)} per device) is "
                + (
                    f"split {split} ways, over every device here, already"
                    if split > 1
                    else "whole on the one device here"
                )
                + "; only a mesh of more devices splits it further (plan one before "
                "having it: plan's Limits).",
            )
        )
    elif split > 1:
        state_advice.append(
            Advice(
                Fix.FSDP,
                f"More FSDP: split the variables over more of the {device_count} devices "
                f"(a larger fsdp degree; now {split} ways): the state "
                f"({format_bytes(state)} per device) falls with the device count.",
            )
        )
    else:
        state_advice.append(
            Advice(
                Fix.FSDP,
                "Use jstrategy.experimental.FSDPStrategy(): parameters, gradients and "
                f"optimizer state ({format_bytes(state)} per device here) split over the "
                f"{device_count} devices instead of one copy each.",
            )
        )
    # Offloaded already, the optimizer state left in device memory is its scalars.
    # (A pipeline's strategy keeps its optimizer state on the devices.)
    if pipeline is None and plan.optimizer_state * 100 >= plan.peak:
        state_advice.append(
            Advice(
                Fix.OFFLOAD_OPTIMIZER,
                "offload_optimizer=True (FSDPStrategy, ModelParallelStrategy or "
                "HybridStrategy): the optimizer state "
                f"({format_bytes(plan.optimizer_state)} per device) in host memory.",
            )
        )
    batch_advice = []
    if remat in ("ready", "wrap"):
        how = (
            "the model's jstrategy.training.remat blocks"
            if remat == "ready"
            else "with the model's repeated blocks wrapped by jstrategy.training.remat"
        )
        batch_advice.append(
            Advice(
                Fix.REMAT,
                f"remat=True (make_train_step or Model.compile), {how}: recompute "
                f"activations ({format_bytes(plan.activations)} per device) in the "
                "backward pass.",
            )
        )
    if pipeline is not None:
        batch_advice += pipeline_batch
    largest = plan.largest_batch
    if largest:
        k = _accumulation_for(plan.batch_size, largest, multiple)
        if k is not None:
            batch_advice.append(
                Advice(
                    Fix.MICROBATCHES,
                    f"gradient_accumulation_steps={k * accumulation_steps} with batches of "
                    f"{plan.batch_size // k}: the same update from {k}x smaller batches.",
                )
            )
        batch_advice.append(
            Advice(
                Fix.SMALLER_BATCH,
                f"A global batch of at most {largest} (this one needs "
                f"{format_bytes(over)} more per device).",
            )
        )
    state_bound = state >= plan.activations + plan.inputs
    return tuple(state_advice + batch_advice if state_bound else batch_advice + state_advice)


def _pipeline_advice(
    plan: MemoryPlan, pipeline: PipelineConfig, split: int, device_count: int
) -> tuple[list[Advice], list[Advice]]:
    """A pipeline's own fixes, ``(for its state, for its activations)``: more stages, its
    stages' variables split over their replicas, more microbatches, the 1F1B schedule;
    only those its mesh and batch can take."""
    stages, micro = pipeline.num_stages, pipeline.num_microbatches
    replicas = pipeline.num_replicas
    state = plan.parameters + plan.optimizer_state + plan.gradients
    state_advice = []
    if device_count % (2 * stages) == 0:
        state_advice.append(
            Advice(
                Fix.MORE_STAGES,
                f"More stages: num_stages={2 * stages} (now {stages}) gives each device "
                f"half of its stage's layers and their state ({format_bytes(state)} per "
                "device now); the repeated block's num_layers must divide by it.",
            )
        )
    if replicas > 1 and split <= stages:
        # Split no further than over the stages: each stage's replicas hold whole copies.
        state_advice.append(
            Advice(
                Fix.FSDP,
                "shard_over_replicas=True (PipelineStrategy): split each stage's "
                f"variables over its {replicas} replicas as FSDP does, the state "
                f"({format_bytes(state)} per device now) about {replicas}x smaller.",
            )
        )
    if not state_advice:
        state_advice.append(
            Advice(
                Fix.MORE_DEVICES,
                f"More devices: the state ({format_bytes(state)} per device) is split "
                f"over the {stages} stages and their replicas already; only a mesh of "
                "more devices (more stages or replicas) splits it further.",
            )
        )
    batch_advice = []
    rows = plan.batch_size // max(1, replicas)
    if rows % (2 * micro) == 0:
        batch_advice.append(
            Advice(
                Fix.PIPELINE_MICROBATCHES,
                f"More microbatches: num_microbatches={2 * micro} (now {micro}): each "
                f"microbatch's temporaries halve ({format_bytes(plan.activations)} of "
                "activations and temporaries per device now), and so does the bubble.",
            )
        )
    if pipeline.schedule.value == "gpipe" and micro > 2 * stages - 1:
        batch_advice.append(
            Advice(
                Fix.SCHEDULE,
                f"schedule='1f1b': a stage keeps the inputs of at most {2 * stages - 1} "
                f"microbatches for the backward pass instead of all {micro} (GPipe's).",
            )
        )
    return state_advice, batch_advice


def _accumulation_for(batch: int, largest: int, multiple: int) -> int | None:
    """The fewest microbatches k splitting `batch` into batches of at most `largest` rows,
    each a multiple of `multiple`, or None."""
    for k in range(2, batch // multiple + 1):
        if batch % k == 0 and (batch // k) % multiple == 0 and batch // k <= largest:
            return k
    return None
