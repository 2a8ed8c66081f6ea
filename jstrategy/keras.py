"""Keras 3 models (JAX backend) under jstrategy's strategies (``pip install 'jstrategy[keras]'``).

Two routes (docs/guides/keras-3-models.md):

* Keras's own ``fit``: create and compile a ``keras.Model`` inside ``strategy.scope()``;
  the scope makes a ``keras.distribution`` backed by the strategy current
  (`StrategyDistribution`), so Keras's trainer places variables and batches as the strategy
  says and its ``fit``, ``evaluate`` and ``predict`` run distributed, inside the scope or
  out (MultiWorkerMirrored included, each process giving its rows).
* jstrategy's own training: `KerasModule` makes a ``keras.Model`` a Flax module
  (``stateless_call``), so `jstrategy.Model`, the train-step factory, ``strategy.run`` and
  jstrategy's checkpoints train it under every strategy, CentralStorage and host-memory
  offload included; `loss` and `optimizer` take Keras's own losses and optimizers there.

Importing this module imports Keras, which must run on JAX (``KERAS_BACKEND=jax``).
"""

from jstrategy._src.keras3.compile_objects import KerasLoss
from jstrategy._src.keras3.compile_objects import loss
from jstrategy._src.keras3.compile_objects import optimizer
from jstrategy._src.keras3.distribution import StrategyDistribution
from jstrategy._src.keras3.distribution import distribution_for
from jstrategy._src.keras3.module import KerasModule
from jstrategy._src.keras3.module import write_back

__all__ = [
    "KerasLoss",
    "KerasModule",
    "StrategyDistribution",
    "distribution_for",
    "loss",
    "optimizer",
    "write_back",
]
