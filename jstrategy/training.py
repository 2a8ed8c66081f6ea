"""Train steps and train states for Flax linen and NNX, and the Keras-like `Model`.

Example:

>>> import jstrategy.training as training
>>> callable(training.make_train_step)
True
"""

from jstrategy._src.placement import place_state
from jstrategy._src.training.fit_runner import FitState
from jstrategy._src.training.model import Model
from jstrategy._src.training.state.global_batch import BatchNormSync
from jstrategy._src.training.state.nnx import NNXTrainState
from jstrategy._src.training.state.nnx import create_nnx_train_state
from jstrategy._src.training.state.train_state import TrainState
from jstrategy._src.training.state.train_state import TrainStateProtocol
from jstrategy._src.training.state.train_state import compile_train_state_creation
from jstrategy._src.training.state.train_state import create_train_state
from jstrategy._src.training.step.accumulation import GradientAccumulator
from jstrategy._src.training.step.factory import EvalStep
from jstrategy._src.training.step.factory import PredictStep
from jstrategy._src.training.step.factory import TrainStep
from jstrategy._src.training.step.factory import make_eval_step
from jstrategy._src.training.step.factory import make_predict_step
from jstrategy._src.training.step.factory import make_train_step
from jstrategy._src.training.step.remat import remat

__all__ = [
    "BatchNormSync",
    "EvalStep",
    "FitState",
    "GradientAccumulator",
    "Model",
    "NNXTrainState",
    "PredictStep",
    "TrainState",
    "TrainStateProtocol",
    "TrainStep",
    "compile_train_state_creation",
    "create_nnx_train_state",
    "create_train_state",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
    "place_state",
    "remat",
]
