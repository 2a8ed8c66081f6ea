"""A ``keras.distribution.Distribution`` backed by a jstrategy strategy: Keras's own ``fit``.

Keras 3's JAX trainer compiles its steps for the current ``keras.distribution``: variables
are created with its ``get_variable_layout``, batches placed with its ``get_data_layout``,
and the step is one ``jax.jit`` over the global batch (XLA partitions it). Here that
distribution is the strategy's: its mesh, each variable where `Strategy.variable_sharding`
puts it (replicated for the mirrored strategies, split by FSDP's rules or the LayoutMap's
keys over Keras's variable paths, ``("params", "dense", "kernel")`` for ``dense/kernel``),
the batch split as `Strategy.batch_sharding` says. The step computes over the global batch,
so BatchNormalization's statistics and Dropout's masks (JAX's partitionable threefry) are
one device's, whatever the mesh.

A Keras model compiled inside a strategy's scope keeps its distribution: its ``fit``,
``evaluate``, ``predict`` and ``*_on_batch`` outside the scope run under it, as a TF Keras
model keeps the strategy it was created in (`capture`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from keras.src.distribution import distribution_lib

from jstrategy._src.keras3.backend import require_keras
from jstrategy._src.strategy import Strategy

__all__ = ["StrategyDistribution", "capture", "distribution_for", "refusal", "refusing"]

require_keras("jstrategy.keras")

#: The strategies whose variables or steps Keras's own trainer cannot hold, and why.
_REFUSED = {
    "CentralStorageStrategy": (
        "keeps one copy of every variable in host memory and updates it there, which "
        "Keras's own trainer (keras.Model.fit) cannot do"
    ),
    "ParameterServerStrategy": (
        "trains through a ClusterCoordinator's workers, which Keras's own trainer "
        "(keras.Model.fit) cannot drive"
    ),
    "PipelineStrategy": (
        "splits a jstrategy.experimental.Repeated block over pipeline stages, which a "
        "keras.Model has none of"
    ),
}


def refusal(strategy: Any) -> str | None:
    """Why a keras.Model's own trainer cannot run under `strategy`, or None."""
    name = type(strategy).__name__
    if name not in _REFUSED:
        return None
    return (
        f"A keras.Model's own fit, evaluate and predict cannot run under {name}: it "
        f"{_REFUSED[name]}. Train it through jstrategy instead: "
        "jstrategy.Model(jstrategy.keras.KerasModule(model), input_shape) (or "
        "jstrategy.training.create_train_state with a KerasModule), which every strategy runs."
    )


class _ShardingLayout(keras.distribution.TensorLayout):
    """A ``TensorLayout`` that is a given ``NamedSharding``: axes Keras cannot write (a
    tuple of mesh axes for one dimension) and the strategy's own mesh object, so Keras's
    shardings compare equal to the strategy's."""

    def __init__(self, sharding: NamedSharding, device_mesh: Any):
        self._sharding = sharding
        super().__init__(tuple(sharding.spec), device_mesh)

    def _validate_axes(self) -> None:  # the sharding was made by the strategy: valid
        pass

    @property
    def backend_layout(self) -> NamedSharding:
        return self._sharding


class StrategyDistribution(distribution_lib.Distribution):
    """Keras's distribution of a jstrategy strategy (made by `distribution_for`).

    Args:
      strategy: the strategy whose mesh, variable placement and batch placement Keras's
        trainer follows.

    Raises:
      ValueError: a strategy Keras's own trainer cannot express (CentralStorage,
        ParameterServer, Pipeline), naming the route that trains it.

    Example:

    >>> import keras, jstrategy
    >>> from jstrategy.keras import StrategyDistribution
    >>> d = StrategyDistribution(jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]))
    >>> d.get_data_layout((4, 3)).backend_layout.spec
    P('replica', None)
    """

    def __init__(self, strategy: Strategy):
        refused = refusal(strategy)
        if refused is not None:
            raise ValueError(refused)
        mesh = strategy.mesh
        device_mesh = keras.distribution.DeviceMesh(
            tuple(mesh.devices.shape), list(mesh.axis_names), devices=mesh.devices
        )
        # Keras converts its mesh to JAX's lazily and caches it here: the strategy's own.
        device_mesh._backend_mesh = mesh
        self._strategy = strategy
        #: Why Keras's own trainer cannot run under this distribution, or None.
        self.refused: str | None = None
        self._batch_axis = strategy.batch_sharding().spec[0]
        super().__init__(device_mesh, batch_dim_name=strategy.axis_name, auto_shard_dataset=False)

    @property
    def strategy(self) -> Strategy:
        """The strategy this distribution follows."""
        return self._strategy

    @property
    def num_model_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    def _layout(self, sharding: NamedSharding) -> _ShardingLayout:
        return _ShardingLayout(sharding, self.device_mesh)

    def get_data_layout(self, data_shape: Any) -> _ShardingLayout:
        """The batch split by rows over the replicas; replicated when its rows do not
        divide among them (a last smaller batch): the step's numbers are the same."""
        n = self._strategy.num_replicas_in_sync
        rows = data_shape[0] if len(data_shape) else None
        # Keras gives each process's rows; the global batch is every process's.
        if rows is None or (rows * jax.process_count()) % n:
            if jax.process_count() > 1:
                raise ValueError(
                    f"A batch of {rows} rows a process ({jax.process_count()} processes) "
                    f"does not split among {self._strategy!r}'s {n} replicas, and the "
                    "processes' rows differ, so it cannot be replicated either. Choose a "
                    f"batch_size (and a number of rows) that is a multiple of "
                    f"{n // math.gcd(n, jax.process_count())}."
                )
            return self._layout(NamedSharding(self._strategy.mesh, P()))
        spec = P(self._batch_axis, *([None] * (len(data_shape) - 1)))
        return self._layout(NamedSharding(self._strategy.mesh, spec))

    def get_variable_layout(self, variable: Any) -> Any:
        """Where `Strategy.variable_sharding` puts `variable`, by its Keras path."""
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        path = ("params", *str(variable.path).split("/"))
        leaf = jax.ShapeDtypeStruct(
            tuple(variable.shape), jax.dtypes.canonicalize_dtype(variable.dtype)
        )
        sharding = self._strategy.variable_sharding(leaf, path)
        if not isinstance(sharding, NamedSharding) or sharding.mesh != self._strategy.mesh:
            sharding = NamedSharding(self._strategy.mesh, P())
        if sharding.memory_kind not in (None, "device"):
            # Kept in device memory for Keras; a KerasModule takes the values from there.
            # Keras's own trainer cannot update host memory: its runs are refused.
            self.refused = (
                f"{self._strategy!r} keeps the Keras variable {variable.path!r} in host "
                f"memory ({sharding.memory_kind!r}), which Keras's own trainer "
                "(keras.Model.fit) cannot update. Leave `offload` unset for a keras.Model's "
                "own fit, or train it through jstrategy.Model(jstrategy.keras.KerasModule("
                "model), input_shape), which offloads."
            )
            sharding = sharding.with_memory_kind("device")
        return self._layout(sharding)

    def get_tensor_layout(self, path: str) -> None:
        """None: XLA lays out the activations from the variables' and batch's layouts."""
        del path
        return None


_DISTRIBUTIONS: weakref.WeakKeyDictionary[Strategy, StrategyDistribution] = (
    weakref.WeakKeyDictionary()
)


def distribution_for(strategy: Strategy) -> StrategyDistribution:
    """The strategy's one `StrategyDistribution` (made on first use): what its scope makes
    current for Keras.

    Example:

    >>> import keras, jstrategy
    >>> from jstrategy.keras import distribution_for
    >>> strategy = jstrategy.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with strategy.scope():
    ...     print(keras.distribution.distribution() is distribution_for(strategy))
    True
    """
    made = _DISTRIBUTIONS.get(strategy)
    if made is None:
        made = _DISTRIBUTIONS[strategy] = StrategyDistribution(strategy)
    return made


# A model's captured distribution ------------------------------------------------------------
_CAPTURED = "_jstrategy_distribution"
#: The refusal of the strategy whose scope is entered, when Keras's trainer cannot run
#: under it (its scope installs no distribution: Keras's variables stay on one device, where
#: a KerasModule takes them).
_REFUSING: list[str] = []


@contextlib.contextmanager
def refusing(message: str) -> Iterator[None]:
    """Within: a keras.Model compiled here raises `message` when it is run."""
    _REFUSING.append(message)
    try:
        yield
    finally:
        _REFUSING.pop()


_RUNS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def _relayout(model: Any, dist: StrategyDistribution) -> None:
    """Variables made outside the scope (one device) moved where `dist` puts them."""
    for v in model.variables:
        if getattr(v, "_layout", None) is None:
            layout = dist.get_variable_layout(v)
            v._layout = layout
            v._direct_assign(jax.device_put(v.value, layout.backend_layout))


def _compile_capturing(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compile_fn)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        dist = distribution_lib.distribution()
        if _REFUSING and not isinstance(dist, StrategyDistribution):
            object.__setattr__(self, _CAPTURED, _REFUSING[-1])
        if isinstance(dist, StrategyDistribution):
            _relayout(self, dist)
            object.__setattr__(self, _CAPTURED, dist)
        result = compile_fn(self, *args, **kwargs)
        if isinstance(dist, StrategyDistribution) and getattr(self, "optimizer", None):
            _relayout(self.optimizer, dist)
        return result

    compile._jstrategy_wrapped = True  # type: ignore[attr-defined]
    return compile


def _run_under_captured(run_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run_fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        dist = getattr(self, _CAPTURED, None)
        if isinstance(dist, str):
            raise ValueError(dist)
        if isinstance(dist, StrategyDistribution) and dist.refused is not None:
            raise ValueError(dist.refused)
        current = distribution_lib.distribution()
        if dist is None or current is dist:
            return run_fn(self, *args, **kwargs)
        if isinstance(current, StrategyDistribution):
            raise ValueError(
                f"This keras.Model was compiled under {dist.strategy!r}; it cannot "
                f"{run_fn.__name__} inside the scope of {current.strategy!r}. Call it "
                "outside that scope, or create and compile the model in it."
            )
        with dist.scope():
            return run_fn(self, *args, **kwargs)

    run._jstrategy_wrapped = True  # type: ignore[attr-defined]
    return run


def capture() -> None:
    """Makes a ``keras.Model`` compiled in a strategy's scope keep that strategy's
    distribution for its ``fit``/``evaluate``/``predict`` anywhere (idempotent).

    Keras's JAX trainer reads the global ``keras.distribution`` when it runs; TF Keras
    models instead keep the strategy they were made in. ``keras.Model``'s ``compile`` and
    run methods are wrapped once so: a model compiled outside every jstrategy scope is
    untouched.
    """
    for name in ("compile", *_RUNS):
        # Wrapped where Keras defines it (Trainer, JAXTrainer), so Keras's own checks that
        # a model overrides nothing (``cls.compile != Trainer.compile``) still hold.
        owner = next(k for k in keras.Model.__mro__ if name in k.__dict__)
        fn = owner.__dict__[name]
        if not getattr(fn, "_jstrategy_wrapped", False):
            wrap = _compile_capturing if name == "compile" else _run_under_captured
            setattr(owner, name, wrap(fn))
