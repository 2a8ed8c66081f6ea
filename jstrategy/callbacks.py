"""Keras-compatible callbacks for `jstrategy.Model.fit`, `evaluate` and `predict`.

Example:

>>> import jstrategy.callbacks as callbacks
>>> callbacks.EarlyStopping(monitor="val_accuracy", patience=2).patience
2
"""

from jstrategy._src.training.callbacks.base import Callback
from jstrategy._src.training.callbacks.base import History
from jstrategy._src.training.callbacks.base import LambdaCallback
from jstrategy._src.training.callbacks.callback_list import CallbackList
from jstrategy._src.training.callbacks.checkpoints import BackupAndRestore
from jstrategy._src.training.callbacks.checkpoints import ModelCheckpoint
from jstrategy._src.training.callbacks.early_stopping import EarlyStopping
from jstrategy._src.training.callbacks.lr_schedule import LearningRateScheduler
from jstrategy._src.training.callbacks.lr_schedule import ReduceLROnPlateau
from jstrategy._src.training.callbacks.monitor import Mode
from jstrategy._src.training.callbacks.progress import Progbar
from jstrategy._src.training.callbacks.progress import ProgbarLogger
from jstrategy._src.training.callbacks.tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Mode",
    "ModelCheckpoint",
    "Progbar",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
]
