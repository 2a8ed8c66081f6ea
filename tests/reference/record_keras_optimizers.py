"""Records Keras 3's optimizer trajectories for `tests/test_keras_optimizers.py`.

Run with Keras 3 on the JAX backend (Keras is not a test dependency; its numbers are kept
in `tests/data/keras_optimizers_reference.json`, committed)::

    KERAS_BACKEND=jax /work/keras-venv/bin/python tests/reference/record_keras_optimizers.py

Two kinds of case:

* ``direct``: fixed weights (a (4, 3) kernel and a (3,) bias) and a fixed sequence of
  gradients, both written to the file, applied with ``optimizer.apply`` for every step;
  ``rates`` (when given) set ``optimizer.learning_rate`` before each step, as
  ``LearningRateScheduler`` does. Recorded: the weights after every step, and for
  ``use_ema`` the moving average at the end.
* ``fit``: ``Model.fit`` of a Dense(3) model on fixed data from fixed initial weights, no
  shuffling, with a ``LearningRateScheduler`` where given. Recorded: the final weights.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras

STEPS = 12
OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "keras_optimizers_reference.json"

EXP = {
    "class_name": "ExponentialDecay",
    "config": {"initial_learning_rate": 0.1, "decay_steps": 4, "decay_rate": 0.5},
}


def _exp(rate: float, steps: int = 4) -> dict:
    return {
        "class_name": "ExponentialDecay",
        "config": {"initial_learning_rate": rate, "decay_steps": steps, "decay_rate": 0.5},
    }


HALVING = [0.1 * 0.5 ** (i // 4) for i in range(STEPS)]  # a rate halved every 4 steps

# name -> (Keras class, constructor arguments, rates set before each step or None)
DIRECT: dict[str, tuple[str, dict, list[float] | None]] = {
    "sgd": ("SGD", {"learning_rate": 0.1}, None),
    "sgd_exponential": ("SGD", {"learning_rate": EXP}, None),
    "sgd_momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, None),
    "sgd_momentum_exponential": ("SGD", {"learning_rate": EXP, "momentum": 0.9}, None),
    "sgd_momentum_halving": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, HALVING),
    "sgd_nesterov_halving": (
        "SGD",
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
        HALVING,
    ),
    "sgd_nesterov_exponential": (
        "SGD",
        {"learning_rate": EXP, "momentum": 0.9, "nesterov": True},
        None,
    ),
    "sgd_momentum_piecewise": (
        "SGD",
        {
            "learning_rate": {
                "class_name": "PiecewiseConstantDecay",
                "config": {"boundaries": [3, 7], "values": [0.1, 0.05, 0.01]},
            },
            "momentum": 0.8,
        },
        None,
    ),
    "sgd_momentum_inverse_time": (
        "SGD",
        {
            "learning_rate": {
                "class_name": "InverseTimeDecay",
                "config": {"initial_learning_rate": 0.1, "decay_steps": 2, "decay_rate": 0.5},
            },
            "momentum": 0.9,
        },
        None,
    ),
    "sgd_momentum_cosine": (
        "SGD",
        {
            "learning_rate": {
                "class_name": "CosineDecay",
                "config": {"initial_learning_rate": 0.1, "decay_steps": 10, "alpha": 0.1},
            },
            "momentum": 0.9,
        },
        None,
    ),
    "sgd_weight_decay": ("SGD", {"learning_rate": 0.1, "weight_decay": 0.05}, None),
    "sgd_clipnorm": ("SGD", {"learning_rate": 0.1, "momentum": 0.5, "clipnorm": 0.5}, None),
    "sgd_clipvalue": ("SGD", {"learning_rate": 0.1, "clipvalue": 0.1}, None),
    "sgd_loss_scale_factor": ("SGD", {"learning_rate": 0.1, "loss_scale_factor": 128.0}, None),
    "sgd_ema": ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True}, None),
    "sgd_ema_overwrite": (
        "SGD",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "use_ema": True,
            "ema_momentum": 0.8,
            "ema_overwrite_frequency": 3,
        },
        None,
    ),
    "sgd_momentum_accumulation_exponential": (
        "SGD",
        {"learning_rate": EXP, "momentum": 0.9, "gradient_accumulation_steps": 3},
        None,
    ),
    "sgd_accumulation_ema": (
        "SGD",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "gradient_accumulation_steps": 2,
            "use_ema": True,
            "ema_momentum": 0.9,
            "ema_overwrite_frequency": 2,
        },
        None,
    ),
    "adam": ("Adam", {"learning_rate": 0.01}, None),
    "adam_exponential": ("Adam", {"learning_rate": _exp(0.01)}, None),
    "adam_amsgrad": ("Adam", {"learning_rate": 0.01, "amsgrad": True}, None),
    "adam_amsgrad_exponential": ("Adam", {"learning_rate": _exp(0.01), "amsgrad": True}, None),
    "adam_global_clipnorm": ("Adam", {"learning_rate": 0.01, "global_clipnorm": 0.5}, None),
    "adam_accumulation": ("Adam", {"learning_rate": 0.01, "gradient_accumulation_steps": 2}, None),
    "adam_ema": ("Adam", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}, None),
    "adamw": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}, None),
    "adamw_amsgrad_exponential": (
        "AdamW",
        {"learning_rate": _exp(0.01), "weight_decay": 0.1, "amsgrad": True},
        None,
    ),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01}, None),
    "rmsprop_exponential": ("RMSprop", {"learning_rate": _exp(0.01)}, None),
    "rmsprop_momentum_centered_halving": (
        "RMSprop",
        {"learning_rate": 0.01, "momentum": 0.9, "centered": True},
        [r / 10 for r in HALVING],
    ),
    "rmsprop_centered": ("RMSprop", {"learning_rate": 0.01, "centered": True}, None),
    "adagrad": ("Adagrad", {"learning_rate": 0.1}, None),
    "adagrad_exponential": ("Adagrad", {"learning_rate": EXP}, None),
    "adadelta": ("Adadelta", {"learning_rate": 1.0}, None),
    "adadelta_exponential": ("Adadelta", {"learning_rate": _exp(1.0)}, None),
    "adamax": ("Adamax", {"learning_rate": 0.01}, None),
    "adamax_exponential": ("Adamax", {"learning_rate": _exp(0.01)}, None),
    "nadam": ("Nadam", {"learning_rate": 0.01}, None),
    "nadam_exponential": ("Nadam", {"learning_rate": _exp(0.01)}, None),
    "nadam_accumulation": (
        "Nadam",
        {"learning_rate": 0.01, "gradient_accumulation_steps": 2},
        None,
    ),
    "lion": ("Lion", {"learning_rate": 0.01}, None),
    "lion_exponential_weight_decay": (
        "Lion",
        {"learning_rate": _exp(0.01), "weight_decay": 0.1},
        None,
    ),
}

# name -> (Keras class, arguments, epochs, per-epoch rate halving from this rate or None)
FIT: dict[str, tuple[str, dict, int, float | None]] = {
    "fit_sgd_momentum_halving": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, 4, 0.1),
    "fit_sgd_nesterov_halving": (
        "SGD",
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
        4,
        0.1,
    ),
    "fit_sgd_momentum_exponential": ("SGD", {"learning_rate": EXP, "momentum": 0.9}, 3, None),
    "fit_sgd_momentum_accumulation_exponential": (
        "SGD",
        {"learning_rate": EXP, "momentum": 0.9, "gradient_accumulation_steps": 2},
        3,
        None,
    ),
    "fit_sgd_ema": ("SGD", {"learning_rate": 0.05, "momentum": 0.9, "use_ema": True}, 3, None),
}
FIT_ROWS, FIT_BATCH = 32, 8


def _optimizer(class_name: str, kwargs: dict) -> keras.optimizers.Optimizer:
    kwargs = dict(kwargs)
    rate = kwargs.get("learning_rate")
    if isinstance(rate, dict):
        kwargs["learning_rate"] = keras.optimizers.schedules.deserialize(rate)
    return getattr(keras.optimizers, class_name)(**kwargs)


def _ema_average(optimizer: keras.optimizers.Optimizer) -> list[list]:
    return [np.asarray(v.value).tolist() for v in optimizer._model_variables_moving_average]


def record_direct(initial: list[np.ndarray], grads: list[list[np.ndarray]]) -> dict:
    out = {}
    for name, (class_name, kwargs, rates) in DIRECT.items():
        optimizer = _optimizer(class_name, kwargs)
        variables = [keras.Variable(w.copy()) for w in initial]
        trajectory = []
        for step, g in enumerate(grads):
            if rates is not None:
                optimizer.learning_rate = rates[step]
            optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], variables)
            trajectory.append([np.asarray(v.value).tolist() for v in variables])
        case = {"class_name": class_name, "kwargs": kwargs, "rates": rates, "weights": trajectory}
        if kwargs.get("use_ema"):
            case["ema_average"] = _ema_average(optimizer)
        out[name] = case
    return out


def record_fit(initial: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> dict:
    out = {}
    for name, (class_name, kwargs, epochs, halving) in FIT.items():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.layers[0].set_weights(initial)
        model.compile(optimizer=_optimizer(class_name, kwargs), loss="mse")
        callbacks = []
        if halving is not None:
            callbacks.append(
                keras.callbacks.LearningRateScheduler(lambda e, lr, r=halving: r * 0.5**e)
            )
        model.fit(
            x, y, batch_size=FIT_BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
        )
        out[name] = {
            "class_name": class_name,
            "kwargs": kwargs,
            "epochs": epochs,
            "halving_from": halving,
            "weights": [np.asarray(w).tolist() for w in model.layers[0].get_weights()],
        }
    return out


def main() -> None:
    rng = np.random.default_rng(21)
    initial = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)]
    grads = [
        [rng.normal(size=w.shape).astype(np.float32) * (1 + step % 3) for w in initial]
        for step in range(STEPS)
    ]
    x = rng.normal(size=(FIT_ROWS, 4)).astype(np.float32)
    y = rng.normal(size=(FIT_ROWS, 3)).astype(np.float32)
    data = {
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "initial": [w.tolist() for w in initial],
        "grads": [[g.tolist() for g in step] for step in grads],
        "fit_x": x.tolist(),
        "fit_y": y.tolist(),
        "fit_batch_size": FIT_BATCH,
        "direct": record_direct(initial, grads),
        "fit": record_fit(initial, x, y),
    }
    OUT.write_text(json.dumps(data) + "\n")
    print(f"wrote {len(data['direct'])} direct and {len(data['fit'])} fit cases to {OUT}")


if __name__ == "__main__":
    main()
