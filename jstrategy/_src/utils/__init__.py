"""Keras's ``keras.utils`` helpers a porting program calls, as Keras's `keras/src/utils/`:
`to_categorical` and `normalize` (`numerical_utils.py`), `set_random_seed`
(`random_seed.py`); public as `jstrategy.utils`."""
