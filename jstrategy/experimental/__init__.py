"""`jstrategy.experimental`: mirrors `tf.distribute.experimental`, plus sharded variables.

`DeviceMesh`, `LayoutMap`, `ModelParallelStrategy` (Keras 3's `keras.distribution` names)
and `FSDPStrategy` go beyond tf.distribute: variables split over the devices
(`HybridStrategy`: replicas x FSDP x tensor on one mesh, split across hosts);
`PipelineStrategy` splits a `Repeated` block's layers (`NNXRepeated` for Flax NNX) over
pipeline stages; `dot_product_attention` is ring attention over a sharded strategy's
``"context"`` axis; `MoE` and `NNXMoE` are mixture-of-experts layers. `plan` compiles a train step from shapes alone and says whether it
fits the devices, and what to change if not.
"""

from jstrategy._src.activation_rows import TensorActivations
from jstrategy._src.checkpoint.preemption import PreemptionCheckpointHandler
from jstrategy._src.cluster.signals import PREEMPTION_EXIT_CODE
from jstrategy._src.collective_util import CollectiveCommunication
from jstrategy._src.collective_util import CommunicationImplementation
from jstrategy._src.collective_util import CommunicationOptions
from jstrategy._src.context_parallel.attention import dot_product_attention
from jstrategy._src.layout_map import LayoutMap
from jstrategy._src.mesh import DeviceMesh
from jstrategy._src.moe.linen import MoE
from jstrategy._src.moe.losses import dropped_fraction as moe_dropped_fraction
from jstrategy._src.moe.nnx import NNXMoE
from jstrategy._src.moe.routing import RouterSoftmax
from jstrategy._src.moe.routing import expert_capacity
from jstrategy._src.offload import OffloadPolicy
from jstrategy._src.parameter_server.strategy import ParameterServerStrategy
from jstrategy._src.pipeline.nnx_repeated import NNXRepeated
from jstrategy._src.pipeline.repeated import Repeated
from jstrategy._src.pipeline.schedules import PipelineSchedule
from jstrategy._src.pipeline.strategy import PipelineStrategy
from jstrategy._src.strategies.central_storage import CentralStorageStrategy
from jstrategy._src.strategies.fsdp import FSDPStrategy
from jstrategy._src.strategies.hybrid import HybridStrategy
from jstrategy._src.strategies.model_parallel import ModelParallelStrategy
from jstrategy._src.strategies.multi_worker import (
    _DeprecatedMultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from jstrategy._src.strategies.parallel import ParallelStrategy
from jstrategy._src.strategies.tpu import TPUStrategy
from jstrategy._src.strategy import ValueContext
from jstrategy._src.training.plan.planner import plan
from jstrategy._src.training.plan.refusal import CompilerRefusal
from jstrategy._src.training.plan.report import Advice
from jstrategy._src.training.plan.report import Fix
from jstrategy._src.training.plan.report import MemoryPlan
from jstrategy._src.training.plan.topology import topology_devices
from jstrategy.experimental import partitioners

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "Advice",
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CompilerRefusal",
    "DeviceMesh",
    "FSDPStrategy",
    "Fix",
    "HybridStrategy",
    "LayoutMap",
    "MemoryPlan",
    "MoE",
    "ModelParallelStrategy",
    "MultiWorkerMirroredStrategy",
    "NNXMoE",
    "NNXRepeated",
    "OffloadPolicy",
    "ParallelStrategy",
    "ParameterServerStrategy",
    "PipelineSchedule",
    "TensorActivations",
    "PipelineStrategy",
    "PreemptionCheckpointHandler",
    "Repeated",
    "RouterSoftmax",
    "TPUStrategy",
    "ValueContext",
    "dot_product_attention",
    "expert_capacity",
    "moe_dropped_fraction",
    "partitioners",
    "plan",
    "topology_devices",
]
