"""Mixed precision, as Keras's: the dtype `Policy` of layers and steps (`policy.py`) and the
`DynamicLossScale` that keeps float16 gradients finite (`loss_scale.py`); public as
`jstrategy.mixed_precision`."""
