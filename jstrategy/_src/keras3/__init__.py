"""Keras 3 models (JAX backend) under jstrategy's strategies: `jstrategy.keras`.

Two routes, one concern a module: `distribution` (a ``keras.distribution.Distribution``
backed by a strategy, so Keras's own ``fit`` runs distributed; `scope_hook` installs it when
a strategy's scope is entered with Keras imported) and `module` (a ``keras.Model`` as a Flax
module through ``stateless_call``, so jstrategy's own ``fit``, train-step factory, ``run``
and checkpoints train it). `backend` checks that Keras runs on JAX. Only `scope_hook` is
imported with jstrategy, and it imports Keras only when the user already has.
"""
