"""Keras-compatible callbacks for `jstrategy.Model.fit`, `evaluate` and `predict`.

Example:

>>> import jstrategy.callbacks as callbacks
>>> callbacks.EarlyStopping(monitor="val_accuracy", patience=2).patience
2
"""

from jstrategy._src.training.callbacks import BackupAndRestore
from jstrategy._src.training.callbacks import Callback
from jstrategy._src.training.callbacks import CallbackList
from jstrategy._src.training.callbacks import EarlyStopping
from jstrategy._src.training.callbacks import History
from jstrategy._src.training.callbacks import LambdaCallback
from jstrategy._src.training.callbacks import LearningRateScheduler
from jstrategy._src.training.callbacks import Mode
from jstrategy._src.training.callbacks import ModelCheckpoint
from jstrategy._src.training.callbacks import ProgbarLogger
from jstrategy._src.training.callbacks import ReduceLROnPlateau
from jstrategy._src.training.progress import Progbar
from jstrategy._src.training.tensorboard import TensorBoard

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
