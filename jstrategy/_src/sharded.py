"""The common base of strategies whose variables are split across devices.

`FSDPStrategy` and `ModelParallelStrategy` differ in where each variable lives
(`Strategy.variable_sharding`); how their train steps are staged is the same:
`staging.sharded_train_program`.
"""

from __future__ import annotations

from jstrategy._src import staging
from jstrategy._src.strategy import Strategy

__all__ = ["ShardedStrategy"]


class ShardedStrategy(Strategy):
    """A `Strategy` whose `variable_sharding` splits variables across devices.

    Its train steps run in the global view (`staging.sharded_train_program`): XLA gathers
    each parameter where it is read, reduces each gradient where it is produced to the
    parameter's layout, and applies the update to each device's slices, keeping every
    variable where `variable_sharding` says.
    """

    def stage_train_step(
        self, fns: staging.StepFunctions, *, steps: int = 0, stacked: bool = True
    ) -> staging.TrainProgram:
        """One program per call: see `staging.sharded_train_program`."""
        return staging.sharded_train_program(self, fns, steps=steps, stacked=stacked)
