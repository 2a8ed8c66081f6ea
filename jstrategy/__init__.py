"""jstrategy: TensorFlow 2's tf.distribute.Strategy family for JAX and Flax."""

from typing import TYPE_CHECKING

from jstrategy import callbacks
from jstrategy import cluster_resolver
from jstrategy import config
from jstrategy import constraints
from jstrategy import coordinator
from jstrategy import experimental
from jstrategy import layers
from jstrategy import losses
from jstrategy import metrics
from jstrategy import mixed_precision
from jstrategy import models
from jstrategy import optimizers
from jstrategy import regularizers
from jstrategy import tpu
from jstrategy import training
from jstrategy import utils
from jstrategy._src.checkpoint import CheckpointError
from jstrategy._src.checkpoint import CheckpointManager
from jstrategy._src.checkpoint import load_weights
from jstrategy._src.checkpoint import save_weights
from jstrategy._src.cluster.join import PeerFailureError
from jstrategy._src.cluster.rendezvous import ClusterStartupError
from jstrategy._src.context import ReplicaContext
from jstrategy._src.context import experimental_set_strategy
from jstrategy._src.context import get_replica_context
from jstrategy._src.context import has_strategy
from jstrategy._src.context import in_cross_replica_context
from jstrategy._src.cross_device_ops import CrossDeviceOps
from jstrategy._src.cross_device_ops import HierarchicalCopyAllReduce
from jstrategy._src.cross_device_ops import NcclAllReduce
from jstrategy._src.cross_device_ops import ReductionToOneDevice
from jstrategy._src.input.options import InputContext
from jstrategy._src.input.options import InputOptions
from jstrategy._src.input.options import InputReplicationMode
from jstrategy._src.keras3 import scope_hook as _keras_scope_hook  # noqa: F401  (registers)
from jstrategy._src.keras_names import missing_attribute
from jstrategy._src.layers.core import Input
from jstrategy._src.loss_reduction import compute_average_loss
from jstrategy._src.loss_reduction import scale_regularization_loss
from jstrategy._src.parameter_server.strategy import ParameterServerStrategy
from jstrategy._src.reduce_util import ReduceOp
from jstrategy._src.strategies.central_storage import CentralStorageStrategy
from jstrategy._src.strategies.mirrored import MirroredStrategy
from jstrategy._src.strategies.multi_worker import MultiWorkerMirroredStrategy
from jstrategy._src.strategies.one_device import OneDeviceStrategy
from jstrategy._src.strategies.tpu import TPUStrategy
from jstrategy._src.strategy import REPLICA_AXIS
from jstrategy._src.strategy import Strategy
from jstrategy._src.strategy import ValueContext
from jstrategy._src.strategy import get_strategy
from jstrategy._src.training.model import Model
from jstrategy._src.training.sequential import Sequential
from jstrategy._src.values import PerReplica

__version__ = "0.1.0"

__all__ = [
    "REPLICA_AXIS",
    "CentralStorageStrategy",
    "CheckpointError",
    "CheckpointManager",
    "ClusterStartupError",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "Input",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MirroredStrategy",
    "Model",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PeerFailureError",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Sequential",
    "Strategy",
    "TPUStrategy",
    "ValueContext",
    "callbacks",
    "cluster_resolver",
    "compute_average_loss",
    "config",
    "constraints",
    "coordinator",
    "experimental",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "layers",
    "load_weights",
    "save_weights",
    "scale_regularization_loss",
    "losses",
    "metrics",
    "mixed_precision",
    "models",
    "optimizers",
    "regularizers",
    "tpu",
    "training",
    "utils",
]

if not TYPE_CHECKING:  # for type checkers, a missing name stays an error

    def __getattr__(name: str):
        if name == "keras":  # optional: imports Keras, so only when asked for
            import importlib

            return importlib.import_module("jstrategy.keras")
        raise missing_attribute(__name__, name)
