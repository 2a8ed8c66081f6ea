"""What every `jstrategy.layers` layer shares: Keras's names and common arguments, the train flag.

Each layer is a `flax.linen.Module` whose fields are Keras 3's constructor arguments (with
Keras's defaults) and whose ``__call__(inputs, training=None)`` takes Keras's training
flag: `jstrategy.Sequential` passes the train step's flag down, and a Flax module that
holds these layers passes its own.

Keras 3's base ``Layer`` arguments mean here what they mean there: ``trainable=False``
freezes the layer's weights (read when the model is compiled: `training/trainable.py`),
``dtype`` is the layer's precision policy (Keras's mixed-precision guide's
``Activation("softmax", dtype="float32")``), ``input_shape`` / ``input_dim`` give a
`Sequential`'s row shape. The Keras arguments a layer does not take, and any other
unknown keyword, raise `LayerArgumentError` naming the layer, the argument and what to
use instead, before anything is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import itertools
import re
from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jstrategy._src.layers import symbolic
from jstrategy._src.precision import policy as mp
from jstrategy._src.registry import register_kind
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import check_row_shape

__all__ = [
    "TRAIN_KEYWORDS",
    "Layer",
    "LayerArgumentError",
    "auto_name",
    "call_layer",
    "keras_name",
    "train_keyword",
    "train_kwargs",
]

#: The keywords by which modules take the training mode, and each one's value in training,
#: in the order a module's ``__call__`` is searched for them: Flax's ``train``, Keras's
#: ``training``, Flax's ``deterministic`` (negated). The one table: `Model`'s forward pass,
#: `Sequential`'s layers and the layer plan all read it.
TRAIN_KEYWORDS = {"train": True, "training": True, "deterministic": False}

# Keras 3 (and tf.keras) layer arguments that jstrategy's layers do not take: what to do
# instead. An argument a layer honours is one of its fields and never looked up here.
_REFUSED: dict[str, str] = {
    "activity_regularizer": (
        "An activity penalty would depend on how the batch is cut into replicas and on "
        "the padding rows of a partial batch, so jstrategy's layers do not take one. "
        "Penalize the weights instead (kernel_regularizer=jstrategy.regularizers.L2(...))."
    ),
    "lora_rank": (
        "LoRA is not built into jstrategy's layers. Freeze the layer (trainable=False) and "
        "add a low-rank Flax module beside it in your own module."
    ),
    "lora_alpha": "LoRA is not built into jstrategy's layers; see lora_rank.",
    "quantization_config": "Quantized layers are not provided; drop the argument.",
    "weights": (
        "Give the initial values as an initializer instead, e.g. "
        "embeddings_initializer=jax.nn.initializers.constant(matrix), or call "
        "model.set_weights(...) once the model is built."
    ),
    "batch_size": "The batch size comes from the data: fit(x, y, batch_size=...).",
    "autocast": (
        "Floating inputs are always cast to the layer's compute dtype; to compute a layer "
        "in float32 under a mixed policy pass dtype='float32'."
    ),
    "rms_scaling": "RMS scaling is not provided: use flax.linen.RMSNorm as the layer.",
    "renorm": "Batch renormalization is not provided (Keras 3 dropped it too).",
    "fused": "Drop it: Keras 3 dropped `fused` too.",
    "virtual_batch_size": "Drop it: Keras 3 dropped `virtual_batch_size` too.",
    "sparse": "Sparse inputs are not supported: pass dense NumPy arrays.",
    "ragged": "Ragged inputs are not supported: pad the rows to one length.",
    "input_tensor": "Pass the shape of one row instead: Input(shape=...).",
}
# Keras's other names of a row shape (InputLayer's own is `shape`, Keras 2's input_shape).
_ROW_SHAPE_ALIASES = (
    "input_shape",
    "input_dim",
    "batch_input_shape",
    "batch_shape",
    "input_length",
)


_MADE = itertools.count()


class LayerArgumentError(TypeError, ValueError):
    """A keyword argument a `jstrategy.layers` layer does not take.

    Python raises `TypeError` for an unexpected keyword and Keras 3 `ValueError`
    ("Unrecognized keyword arguments"), so this is both: either habit's ``except`` catches
    it.
    """


def keras_name(class_name: str) -> str:
    """A layer class's name as Keras names its instances: ``"Conv2D"`` -> ``"conv2d"``.

    Keras's ``to_snake_case`` (digits stay with the word before them).

    Example:

    >>> keras_name("MaxPooling2D"), keras_name("BatchNormalization"), keras_name("Dense")
    ('max_pooling2d', 'batch_normalization', 'dense')
    """
    name = re.sub(r"\W+", "", class_name)
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def auto_name(layer: Any, taken: Any) -> str:
    """A name for `layer` as Keras makes one, unique among the names `taken`.

    Keras counts the names it made for each class (``dense``, ``dense_1``, ...); names
    given explicitly take no number.

    Example:

    >>> import jstrategy
    >>> auto_name(jstrategy.layers.Dense(2), {"dense", "dense_1", "out"})
    'dense_2'
    """
    base = keras_name(type(layer).__name__)
    names = {name for name in taken if isinstance(name, str)}
    made = re.compile(rf"{re.escape(base)}(_\d+)?")
    index = sum(1 for name in names if made.fullmatch(name))
    name = base if index == 0 else f"{base}_{index}"
    while name in names:
        index += 1
        name = f"{base}_{index}"
    return name


def _python_scalars(value: Any) -> Any:
    """NumPy scalars (``y.max() + 1``) as Python's, inside tuples and lists too, so a
    layer's config is JSON as Keras's is."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_python_scalars(v) for v in value)
    return value


def _shown(value: Any) -> str:
    """`value`'s repr on one line, cut to 60 characters (arrays are long)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _row_shape(cls: type, key: str, value: Any) -> tuple[Any, ...] | None:
    """The row shape that Keras's `key` (an alias of ``input_shape``) gives, or None."""
    if value is None:
        return None
    if key == "input_shape":
        return tuple(np.atleast_1d(value))
    if key in ("input_dim", "input_length"):
        return (value,)
    if not isinstance(value, (tuple, list)) or len(value) < 2:
        raise LayerArgumentError(
            f"{cls.__name__}: `{key}` must be (batch, *row_shape), e.g. (None, 10); got "
            f"{value!r}. Or pass input_shape=, the shape of one row."
        )
    return tuple(value[1:])


def _is_row_shape_alias(cls: type, key: str) -> bool:
    # Keras 2's Embedding(input_length=) is the length of each row; Keras 3 ignores it.
    return key in _ROW_SHAPE_ALIASES and (key != "input_length" or cls.reads_input_length)  # type: ignore[attr-defined]


def _keras_arguments(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for `cls`'s dataclass constructor: Keras's aliases of the row shape
    translated, and every other keyword the layer does not take refused."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    target = "input_shape" if "input_shape" in fields else "shape"
    out = {}
    for key, value in kwargs.items():
        if key in fields:
            out[key] = value
        elif _is_row_shape_alias(cls, key):
            shape = _row_shape(cls, key, value)
            given = out.get(target, kwargs.get(target))
            if shape is not None and given is not None and tuple(np.atleast_1d(given)) != shape:
                raise LayerArgumentError(
                    f"{cls.__name__}: `{key}`={value!r} and `{target}`={given!r} disagree; "
                    f"pass one of them ({target}={shape!r})."
                )
            if shape is not None:
                out[target] = shape
        elif key == "autocast" and value is True:
            pass  # Keras's default: floating inputs are cast to the compute dtype
        elif key in _REFUSED:
            raise LayerArgumentError(
                f"{cls.__name__} does not take `{key}` ({key}={_shown(value)}). {_REFUSED[key]}"
            )
        else:
            known = sorted(f for f in fields if f != "parent")
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise LayerArgumentError(
                f"{cls.__name__} got an unexpected keyword argument `{key}`.{hint} Its "
                f"arguments are {', '.join(known)}."
            )
    return out


class Layer(nn.Module):
    """The base of `jstrategy.layers`: a linen module with Keras's conventions.

    Subclasses declare Keras's arguments as fields (``input_shape`` last, the shape of one
    input row, read by `jstrategy.Sequential` from its first layer) and check them in
    `validate`, so a bad argument fails when the layer is made. Every layer also takes
    Keras's base-layer arguments, by keyword:

    Attributes:
      trainable: False freezes the layer's weights: a model compiled after it was set
        does not update them (and a frozen `BatchNormalization` runs in inference mode),
        as Keras 3. It may be set on the layer later (``model.layers[0].trainable =
        False``), then compile again, as in Keras.
      dtype: the layer's precision policy, a `jstrategy.mixed_precision.Policy` or its
        name (``"float32"``, ``"mixed_bfloat16"``, ...): its floating inputs and weights
        are cast to the policy's compute dtype, and so its outputs are in it. None: the
        model's policy. The weights are kept in the model's variable dtype.

    Example:

    >>> from jstrategy.layers import Dense, Layer
    >>> isinstance(Dense(4), Layer)
    True
    >>> try:
    ...     Dense(0)
    ... except ValueError as error:
    ...     print(str(error)[:30])
    `units` must be a positive int
    """

    # Keyword-only, as in Keras, so that each subclass's own arguments come first.
    _: dataclasses.KW_ONLY
    trainable: bool = True
    dtype: Any = None

    #: The dtype of the sample row a `Sequential` starting with this layer is built from.
    sample_dtype: ClassVar[str] = "float32"
    #: Whether the layer makes weights (which a per-layer ``dtype`` policy may not store
    #: in another dtype than the model's).
    has_weights: ClassVar[bool] = False
    #: Whether Keras's ``input_length`` (Embedding's) gives the row shape.
    reads_input_length: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # Flax makes `cls` a dataclass
        init = cls.__dict__["__init__"]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **_keras_arguments(type(self), kwargs))

        cls.__init__ = __init__  # type: ignore[method-assign]
        call = cls.__dict__.get("__call__")
        if call is not None:
            # Called before any model binds it, on the symbolic tensors of the functional
            # API (`jstrategy.Input`), the layer records the call instead of running.
            @functools.wraps(call)
            def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
                if self.scope is None and symbolic.contains_symbolic(args, kwargs):
                    return symbolic.symbolic_call(self, args, kwargs)
                return call(self, *args, **kwargs)

            cls.__call__ = __call__  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name != "parent":
                value = getattr(self, field.name)
                converted = _python_scalars(value)
                if converted is not value:
                    object.__setattr__(self, field.name, converted)
        shape = getattr(self, "input_shape", None)
        if shape is not None:
            object.__setattr__(self, "input_shape", check_row_shape(shape, "input_shape"))
        check_bool(self.trainable, "trainable")
        # When the layer was made: a functional model names its unnamed layers in this
        # order, as Keras names layers when they are made (``dense`` before ``dense_1``).
        object.__setattr__(self, "_made", next(_MADE))
        self._check_dtype()
        type(self).validate(self)
        super().__post_init__()

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def _check_dtype(self) -> None:
        if self.dtype is None:
            return
        dtype = self.dtype
        if not isinstance(dtype, (str, mp.Policy)):
            # A dtype object (jnp.float32, np.dtype("float32")): its name, as Keras reads
            # it; anything else goes to as_policy, whose error names the argument.
            with contextlib.suppress(TypeError):
                dtype = np.dtype(dtype).name
        policy = mp.as_policy(dtype, argument="dtype")
        if self.has_weights and policy.variable_dtype != "float32":
            raise ValueError(
                f"{type(self).__name__}: `dtype`={policy.name!r} would keep this layer's "
                f"weights in {policy.variable_dtype} (Keras does), but a jstrategy model keeps "
                f"all its variables in its dtype_policy's variable dtype. Pass "
                f"dtype='mixed_{policy.compute_dtype}' to compute in "
                f"{policy.compute_dtype} with float32 weights, or give the model "
                f"dtype_policy={policy.name!r}."
            )
        object.__setattr__(self, "dtype", policy.name)

    @staticmethod
    def validate(self: Any) -> None:  # static: Flax does not wrap it (no bound scope yet)
        """Checks the constructor's arguments (raises `ValueError` naming the argument)."""

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def cast_inputs(self, inputs: Any) -> Any:
        """`inputs` in the layer's compute dtype, if it has a ``dtype`` policy and they
        are floating (Keras's autocast); as they are otherwise."""
        if self.dtype is None or not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
            return inputs
        return jnp.asarray(inputs).astype(mp.Policy(self.dtype).compute_dtype)

    @nn.nowrap  # a plain helper: no scope of its own, no interception
    def compute_dtype(self, *arrays: Any) -> Any:
        """The dtype the layer computes `arrays` (its inputs and weights) in: its policy's
        compute dtype, or (no policy) the one the arrays promote to."""
        if self.dtype is not None:
            return jnp.dtype(mp.Policy(self.dtype).compute_dtype)
        return jnp.result_type(*arrays)


def train_keyword(layer: Any) -> str | None:
    """The keyword by which `layer` (a linen module) takes the training mode, or None: the
    first of `TRAIN_KEYWORDS` its ``__call__`` has (Keras's ``training`` for
    `jstrategy.layers`)."""
    if isinstance(layer, Layer):
        return "training"
    try:
        params = inspect.signature(type(layer).__call__).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in TRAIN_KEYWORDS if k in params), None)


def train_kwargs(keyword: str | None, training: bool) -> dict[str, bool]:
    """The keyword arguments that put a module taking `keyword` in training mode
    `training` (``{}`` for None).

    Example:

    >>> train_kwargs("deterministic", True), train_kwargs("train", False), train_kwargs(None, True)
    ({'deterministic': False}, {'train': False}, {})
    """
    if keyword is None:
        return {}
    return {keyword: training if TRAIN_KEYWORDS[keyword] else not training}


def call_layer(layer: Any, x: Any, training: bool) -> Any:
    """``layer(x)`` in training mode `training`, given the way `layer` takes the mode.

    `jstrategy.layers` take Keras's ``training``; Flax modules ``train``, ``training`` or
    ``deterministic`` (negated) when their ``__call__`` has one; plain functions nothing.
    """
    if not isinstance(layer, nn.Module):
        return layer(x)
    return layer(x, **train_kwargs(train_keyword(layer), training))


# Every layer a saved config names derives from Layer (checked as it registers).
register_kind("layer", Layer)
