"""A model's compiled programs: the train step's, evaluation's and prediction's.

A `Trainer` sets one `Programs` when it compiles or takes a new state (the programs are
traced for the state's structure) and never changes it after: the loops
(`fit_loop.py`, `fit_runner.py`) read their programs from it, and each program is built
the first time it is read, once (prediction needs no `compile`, as in Keras).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING
from typing import Any

import jax

from jstrategy._src.precision import policy as mp
from jstrategy._src.training.step import body as step_lib
from jstrategy._src.training.step.spec import StepSpec

if TYPE_CHECKING:
    from jstrategy._src.strategy import Strategy

__all__ = ["Programs"]


class Programs:
    """The compiled programs of one compiled step (or none, before `compile`) and state.

    Args:
      strategy: the model's strategy.
      policy: the model's precision policy (prediction's outputs).
      spec: the compiled step (`StepSpec`), or None before `compile`.

    Example:

    >>> import jstrategy
    >>> programs = Programs(jstrategy.get_strategy(), mp.Policy("float32"), None)
    >>> programs.train_keys()
    []
    >>> programs.spec
    Traceback (most recent call last):
    ...
    RuntimeError: The model is not compiled; call model.compile(...) first.
    """

    def __init__(self, strategy: Strategy, policy: mp.Policy, spec: StepSpec | None):
        self.strategy = strategy
        self.policy = policy
        self._spec = spec
        self._train: dict[tuple[int, bool], step_lib.TrainProgram] = {}

    @property
    def spec(self) -> StepSpec:
        """The compiled step."""
        if self._spec is None:
            raise RuntimeError("The model is not compiled; call model.compile(...) first.")
        return self._spec

    def train(self, steps: int, stacked: bool) -> step_lib.TrainProgram:
        """``(state, acc, batch, mask) -> (state, acc, logs)`` running `steps` steps
        (`step.build_train_program`)."""
        program = self._train.get((steps, stacked))
        if program is None:
            program = step_lib.build_train_program(self.spec, steps=steps, stacked=stacked)
            self._train[(steps, stacked)] = program
        return program

    def train_keys(self) -> list[tuple[int, bool]]:
        """The ``(steps, stacked)`` of the train programs built so far, sorted."""
        return sorted(self._train)

    @functools.cached_property
    def eval(self) -> Any:
        """``(state, acc, batch, mask) -> (acc, logs)`` for one evaluation batch."""
        return step_lib.build_eval_program(self.spec)

    @functools.cached_property
    def predict(self) -> Any:
        """``(state, x) -> y_pred`` for one batch."""
        return step_lib.build_predict_program(self.strategy, self.policy)

    def zero_sums(self) -> dict[str, jax.Array]:
        """The running sums an epoch or an evaluation starts from, replicated."""
        return jax.device_put(self.spec.zero_sums(), self.strategy.replicated_sharding())

    def ordered(self, logs: dict[str, Any]) -> dict[str, Any]:
        """`logs` in Keras's order: the loss, then the metrics."""
        # Programs return dicts with sorted keys.
        return {k: logs[k] for k in self.spec.names if k in logs}
