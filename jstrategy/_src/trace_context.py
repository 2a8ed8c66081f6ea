"""What a train step's trace reads besides its arguments: one frozen `TraceContext`.

A model traced inside a train step behaves as the step says: `jstrategy.training.remat`
reads the step's checkpoint policy, `jstrategy.experimental.Repeated` its pipeline, the
layers whose result depends on the batch its `batch_region.Region`, a marked block's input
its rows' placement (`activation_rows`), the attention its context axis
(`context_parallel.axis`); a function traced by `strategy.run` its frame (`tracked`: the
stateful objects it uses), and a model traced for its summary the recorder of its layers'
calls (`summary`). Those settings are one record, held in one context variable (each
thread, and each nested trace, sees the record it entered): the step sets it once, where it
is traced (`tracing`); the modules above read their field through their own accessor
(`remat.remat`, `repeated.current`, `batch_region.current`, `activation_rows.place`,
`context_parallel.axis.current`), and a part of the trace that narrows one field (the
forward pass's region, a pipeline stage's placement) enters a copy with that field replaced
(`replaced`), never a variable of its own.

This module is a helper: it imports nothing of jstrategy, so its fields are typed `Any` and
each is documented by the module that reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["TraceContext", "current", "replaced", "tracing"]


@dataclasses.dataclass(frozen=True)
class TraceContext:
    """The trace-time settings of the step (or other trace) being traced (all None outside
    one).

    Attributes:
      remat: the step's remat record (`training.step.remat`: its checkpoint policy, and
        whether the model used it), or None: no policy in effect.
      pipeline: the `pipeline.repeated.Tracing` that `Repeated` blocks run as a pipeline,
        or None: blocks run their layers in order.
      activation_rows: where `activation_rows.place` puts a marked block's input, or None:
        nowhere (see that module).
      region: the `batch_region.Region` of the forward pass being traced, or None.
      context_axis: the `context_parallel.axis.ContextAxis` the step splits sequences
        over, or None.
      context_refusal: what the attention says when a program of a context-parallel
        strategy that splits no sequence calls it (`context_parallel.axis.refusing`), or None.
      run_frame: the `tracked.RunFrame` of the function `strategy.run` traces (the
        holders it reads and updates), or None.
      summary_recorder: what an NNX layer called while `Model.summary` traces the model
        reports to (`summary`), or None.

    Example:

    >>> with tracing(TraceContext(remat="policy")):
    ...     current().remat
    'policy'
    >>> current().remat is None
    True
    """

    remat: Any = None
    pipeline: Any = None
    activation_rows: Any = None
    region: Any = None
    context_axis: Any = None
    context_refusal: Any = None
    run_frame: Any = None
    summary_recorder: Any = None


_OUTSIDE = TraceContext()
_CONTEXT: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "jstrategy_trace_context", default=None
)


def current() -> TraceContext:
    """The `TraceContext` in effect (all fields None outside a train step's trace)."""
    return _CONTEXT.get() or _OUTSIDE


@contextlib.contextmanager
def tracing(context: TraceContext) -> Iterator[TraceContext]:
    """Within: `current` is `context`."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def replaced(**fields: Any) -> contextlib.AbstractContextManager[TraceContext]:
    """`tracing` the current context with `fields` replaced (the others as they are).

    Example:

    >>> with replaced(region="r"), replaced(pipeline="p"):
    ...     current().region, current().pipeline
    ('r', 'p')
    """
    return tracing(dataclasses.replace(current(), **fields))
