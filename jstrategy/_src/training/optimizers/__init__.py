"""Keras's optimizers over optax: the base, one family a file, Keras's update as one optax
transformation, schedules, the learning rate's one slot, and get/serialize."""
