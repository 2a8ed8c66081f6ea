"""`jstrategy.coordinator`: mirrors `tf.distribute.experimental.coordinator`.

Asynchronous training with `jstrategy.ParameterServerStrategy`: the `ClusterCoordinator`
schedules functions on the workers and returns `RemoteValue` objects; per-worker datasets and
`PerWorkerValues` give each worker its own input. The variables a strategy places on its
parameter servers are `Variable` and `ShardedVariable` objects, grouped in a `VariableTree`.

Example:

>>> import jstrategy
>>> from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver
>>> strategy = jstrategy.ParameterServerStrategy(local_cluster_resolver(num_workers=2))
>>> coordinator = ClusterCoordinator(strategy)
>>> coordinator.fetch([coordinator.schedule(lambda x: x * 2, args=(i,)) for i in range(3)])
[0, 2, 4]
>>> coordinator.shutdown()
"""

from jstrategy._src.parameter_server.backend import ParameterServerFailureError
from jstrategy._src.parameter_server.backend import WorkerFailureError
from jstrategy._src.parameter_server.coordinator import ClusterCoordinator
from jstrategy._src.parameter_server.coordinator import FunctionCancelledError
from jstrategy._src.parameter_server.coordinator import NoWorkersAvailableError
from jstrategy._src.parameter_server.coordinator import PerWorkerDataset
from jstrategy._src.parameter_server.coordinator import PerWorkerDatasetIterator
from jstrategy._src.parameter_server.coordinator import PerWorkerValues
from jstrategy._src.parameter_server.coordinator import RemoteValue
from jstrategy._src.parameter_server.sharded_variable import ShardedVariable
from jstrategy._src.parameter_server.sharded_variable import Variable
from jstrategy._src.parameter_server.sharded_variable import VariableTree
from jstrategy._src.parameter_server.strategy import Backend
from jstrategy._src.parameter_server.strategy import local_cluster_resolver

__all__ = [
    "Backend",
    "ClusterCoordinator",
    "FunctionCancelledError",
    "NoWorkersAvailableError",
    "ParameterServerFailureError",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerValues",
    "RemoteValue",
    "ShardedVariable",
    "Variable",
    "VariableTree",
    "WorkerFailureError",
    "local_cluster_resolver",
]
