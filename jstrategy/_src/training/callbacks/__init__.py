"""Keras's callbacks, one family a file: the hooks and `CallbackList` (`base.py`,
`callback_list.py`), the monitor base (`monitor.py`) under `EarlyStopping`,
`ReduceLROnPlateau` and `ModelCheckpoint`, the learning-rate callbacks, the checkpoint
callbacks, the progress bar and TensorBoard."""
