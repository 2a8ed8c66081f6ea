"""What ``jstrategy_model.json`` in a `Model.save` directory says: written, read, checked.

`saving.py` writes the directory and `loading.py` builds the model again; this module
holds what both must agree on:

* how a loss, metric or optimizer is written and read: by its class's name in the one
  registry of saveable classes (`jstrategy._src.registry`), never as any attribute of a
  module, or by name for one that jstrategy does not define (given back in
  ``custom_objects``);
* the compile configuration (`serialize_compile`), which refuses two different custom
  functions under one name: ``custom_objects`` maps a name to one object, so one of
  them would come back as the other;
* reading the file (`read_config`): every error names the file and the field;
* the module check (`check_module`): the saved module's class against the one given.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Protocol
from typing import TypeVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jstrategy._src.layers import serialization
from jstrategy._src.layers import symbolic
from jstrategy._src.registry import saveable_name
from jstrategy._src.registry import saved_class
from jstrategy._src.training import losses as losses_lib
from jstrategy._src.training import metrics as metrics_lib
from jstrategy._src.training.optimizers import serialization as optimizer_serialization
from jstrategy._src.training.optimizers.base import Optimizer
from jstrategy._src.training.step import remat as remat_lib
from jstrategy._src.validation import check_bool
from jstrategy._src.validation import is_int

__all__ = [
    "CONFIG_FILE",
    "CUSTOM",
    "FORMAT",
    "STATE_DIR",
    "VERSION",
    "CompiledModel",
    "check_module",
    "compile_arguments",
    "field_error",
    "is_saved_model",
    "read_config",
    "serialize_compile",
]

CONFIG_FILE = "jstrategy_model.json"
FORMAT = "jstrategy.Model"
#: The directory in a `Model.save` directory that holds the train state.
STATE_DIR = "state"
VERSION = 1
#: The most numbers a saved ``input_shape`` may hold in one row: the model is built from a
#: sample row of that shape, and a larger one (4 GiB of float32) is no model's.
MAX_ROW_SIZE = 2**30
CUSTOM = "custom"  # the class_name of an object saved by name, given back in custom_objects
_FIX = (
    "Save the model again with model.save(path), or restore the file from a copy; "
    "model.load_weights(path) reads the variables alone into a model you build."
)

_T = TypeVar("_T", bound=type)


# Writing ---------------------------------------------------------------------------------
def _serialize_loss(loss: Any) -> dict[str, Any]:
    name = saveable_name(loss, "loss")
    if name is not None:
        return {"class_name": name, "config": loss.get_config()}
    return {"class_name": CUSTOM, "name": loss.name}


def _serialize_metric(metric: Any) -> dict[str, Any]:
    config = {"name": metric.name, "direction": getattr(metric, "direction", None)}
    if type(metric) is metrics_lib.MeanMetricWrapper and isinstance(metric.fn, losses_lib.Loss):
        fn = _serialize_loss(metric.fn)
        if fn["class_name"] != CUSTOM:
            return {"class_name": "MeanMetricWrapper", "loss": fn, "config": config}
    name = saveable_name(metric, "metric")
    if name is not None:
        return {"class_name": name, "config": metric.get_config()}
    if metric.name in ("accuracy", "acc"):  # resolved from the loss and shapes at compile
        return {"identifier": metric.name}
    if type(metric) is metrics_lib.MeanMetricWrapper:  # a function: rewrapped on loading
        return {"class_name": CUSTOM, "name": metric.name, "direction": config["direction"]}
    return {"class_name": CUSTOM, "name": metric.name}


def _serialize_optimizer(optimizer: Any) -> dict[str, Any]:
    if isinstance(optimizer, Optimizer):
        try:
            return optimizer_serialization.serialize(optimizer)
        except TypeError:  # a schedule that is a plain function
            pass
    return {"class_name": CUSTOM, "name": "optimizer"}


def _given(obj: Any) -> Any:
    """What `custom_objects` gives back for `obj`: the function inside a wrapper."""
    while isinstance(obj, (losses_lib.LossFunctionWrapper, metrics_lib.MeanMetricWrapper)):
        obj = obj.fn
    return obj


def _describe(obj: Any) -> str:
    code = getattr(obj, "__code__", None)
    if code is not None:
        where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        return f"{getattr(obj, '__qualname__', '?')} ({where})"
    return f"a {type(obj).__qualname__}"


def _check_names_apart(entries: list[tuple[str, str, Any]]) -> None:
    """Refuses two different objects saved under one name (`entries`: field, name, object)."""
    seen: dict[str, tuple[str, Any]] = {}
    for field, name, obj in entries:
        if name not in seen:
            seen[name] = (field, obj)
            continue
        first, other = seen[name]
        if _given(other) is not _given(obj):
            raise ValueError(
                f"model.save cannot keep {first} and {field} apart: they are different "
                f"objects, {_describe(_given(other))} and {_describe(_given(obj))}, saved "
                f"by one name, {name!r}, and load_model's custom_objects gives one object "
                f"per name, so one would come back as the other. Give each its own name: "
                f"define them with `def` under different names, or wrap one with a name, "
                f"e.g. jstrategy.metrics.MeanMetricWrapper(fn, name='...') "
                f"(jstrategy.losses.LossFunctionWrapper(fn, name='...') for the loss)."
            )


def is_saved_model(path: str) -> bool:
    """Whether `path` is a directory `Model.save` wrote."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


class CompiledModel(Protocol):
    """What `serialize_compile` reads of a compiled `jstrategy.Model`."""

    @property
    def loss(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def metrics(self) -> Any: ...

    @property
    def weighted_metrics(self) -> Any: ...

    @property
    def steps_per_execution(self) -> int: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    @property
    def sync_batch_norm(self) -> Any: ...

    @property
    def remat(self) -> Any: ...


def _serialize_outputs(per_output: Any, custom: list[tuple[str, Any, Any]]) -> dict[str, Any]:
    """A multi-output functional model's ``compile.outputs``: its losses, loss weights and
    metrics by output name (its `PerOutput`); custom objects are added to `custom`."""
    out: dict[str, Any] = {
        "loss": {k: _serialize_loss(v) for k, v in per_output.losses.items()},
        "loss_weights": dict(per_output.loss_weights),
    }
    for name, obj in per_output.losses.items():
        custom.append((f"the loss compile.outputs.loss.{name}", out["loss"][name], obj))
    for field in ("metrics", "weighted_metrics"):
        out[field] = {}
        for name, objs in getattr(per_output, field).items():
            out[field][name] = [_serialize_metric(m) for m in objs]
            for i, (entry, obj) in enumerate(zip(out[field][name], objs, strict=True)):
                custom.append((f"the metric compile.outputs.{field}.{name}[{i}]", entry, obj))
    return out


def serialize_compile(model: CompiledModel) -> dict[str, Any]:
    """The ``compile`` section of the file for compiled `model`.

    Raises:
      ValueError: if two different custom objects (functions, optax transformations, your
        own classes) would be saved under one name.
    """
    # A functional model of several outputs: its loss and metrics by output name.
    per_output = getattr(model, "output_compile", None)
    loss = None if per_output is not None else model.loss
    metrics = [] if per_output is not None else model.metrics
    weighted_metrics = [] if per_output is not None else model.weighted_metrics
    compiled: dict[str, Any] = {
        "optimizer": _serialize_optimizer(model.optimizer),
        "loss": None if loss is None else _serialize_loss(loss),
        "metrics": [_serialize_metric(m) for m in metrics],
        "steps_per_execution": model.steps_per_execution,
        "gradient_accumulation_steps": model.gradient_accumulation_steps,
        "sync_batch_norm": model.sync_batch_norm.value,
        "weighted_metrics": [_serialize_metric(m) for m in weighted_metrics],
        "remat": remat_lib.policy_name(model.remat),
    }
    custom = [("the optimizer (compile.optimizer)", compiled["optimizer"], model.optimizer)]
    if loss is not None:
        custom.append(("the loss (compile.loss)", compiled["loss"], loss))
    for i, (entry, metric) in enumerate(zip(compiled["metrics"], metrics, strict=True)):
        custom.append((f"the metric compile.metrics[{i}]", entry, metric))
    weighted = zip(compiled["weighted_metrics"], weighted_metrics, strict=True)
    for i, (entry, metric) in enumerate(weighted):
        custom.append((f"the weighted metric compile.weighted_metrics[{i}]", entry, metric))
    if per_output is not None:
        compiled["outputs"] = _serialize_outputs(per_output, custom)
    _check_names_apart(
        [(field, e["name"], obj) for field, e, obj in custom if e.get("class_name") == CUSTOM]
    )
    return compiled


# Reading ---------------------------------------------------------------------------------
def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Fields:
    """Reads fields of the file's JSON, each error naming the file and the field."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, field: str, expected: str, got: str) -> ValueError:
        return ValueError(f"{self.file}: `{field}` must be {expected}; got {got}. {_FIX}")

    def get(
        self,
        obj: dict[str, Any],
        key: str,
        field: str,
        expected: str,
        check: Callable[[Any], bool],
        *,
        default: Any = ...,
    ) -> Any:
        if key not in obj:
            if default is not ...:
                return default
            raise self.fail(field, expected, "nothing (the field is missing)")
        value = obj[key]
        if not check(value):
            raise self.fail(field, expected, _shown(value))
        return value

    def object(self, obj: dict[str, Any], key: str, field: str) -> dict[str, Any]:
        value: dict[str, Any] = self.get(
            obj, key, field, "a JSON object", lambda v: isinstance(v, dict)
        )
        return value

    def string(self, obj: dict[str, Any], key: str, field: str) -> str:
        value: str = self.get(obj, key, field, "a string", lambda v: isinstance(v, str))
        return value


def _is_dtype(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        np.dtype(value)
    except TypeError:
        return False
    return True


def _is_shape(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(is_int(d) and d >= 0 for d in value))


def _check_sample_row(fields: _Fields, config: dict[str, Any]) -> None:
    """What the model is built from: a row of `input_shape` numbers of `input_dtype`,
    bounded, so a damaged file cannot ask JAX for terabytes or build from objects."""
    shape = config["input_shape"]
    if shape is not None and math.prod(shape) > MAX_ROW_SIZE:
        raise fields.fail(
            "input_shape",
            "the shape of one row of at most 2**30 numbers (the model is built from one)",
            f"{_shown(shape)}, {math.prod(shape):,} numbers",
        )
    dtype = np.dtype(config["input_dtype"])
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        raise fields.fail(
            "input_dtype",
            "a NumPy dtype name",
            f"{_shown(config['input_dtype'])}, not a dtype of numbers or bools, which a "
            "model's rows are",
        )


def _check_layers(fields: _Fields, config: dict[str, Any]) -> None:
    """A `Sequential`'s ``layers``: null, or a list of ``{"class_name", "config"}`` (each
    rebuilt by `jstrategy.layers`, whose errors name the field too)."""
    layers = fields.get(
        config,
        "layers",
        "layers",
        "a list of layer configs or null",
        lambda v: v is None or isinstance(v, list),
        default=None,
    )
    for i, entry in enumerate(layers or ()):
        if not isinstance(entry, dict):
            raise fields.fail(f"layers[{i}]", "a JSON object describing a layer", _shown(entry))
        fields.string(entry, "class_name", f"layers[{i}].class_name")
        fields.object(entry, "config", f"layers[{i}].config")
    fields.get(
        config,
        "layer_classes",
        "layer_classes",
        "a list of class names",
        lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
        default=None,
    )


def field_error(path: str, field: str, message: str) -> ValueError:
    """An error about `field` of the configuration in the `Model.save` directory `path`
    (the file and the field named, and the fix)."""
    return ValueError(f"{os.path.join(path, CONFIG_FILE)}: `{field}`: {message} {_FIX}")


def _check_entry(fields: _Fields, entry: Any, field: str, kind: str) -> None:
    """The shape of a loss or metric entry: ``{"class_name", "config"}``, a custom one
    ``{"class_name": "custom", "name"}``, or (metrics) ``{"identifier"}``."""
    if not isinstance(entry, dict):
        raise fields.fail(field, f"a JSON object describing the {kind}", _shown(entry))
    if kind == "metric" and "identifier" in entry:
        fields.get(
            entry,
            "identifier",
            f"{field}.identifier",
            "'accuracy' or 'acc'",
            lambda v: v in ("accuracy", "acc"),
        )
        return
    class_name = fields.string(entry, "class_name", f"{field}.class_name")
    if class_name == CUSTOM:
        fields.string(entry, "name", f"{field}.name")
        return
    fields.object(entry, "config", f"{field}.config")
    if kind == "metric" and class_name == "MeanMetricWrapper":
        _check_entry(fields, entry.get("loss"), f"{field}.loss", "loss")


def _check_compile(fields: _Fields, compiled: dict[str, Any]) -> None:
    optimizer = fields.object(compiled, "optimizer", "compile.optimizer")
    if fields.string(optimizer, "class_name", "compile.optimizer.class_name") == CUSTOM:
        fields.string(optimizer, "name", "compile.optimizer.name")
    loss = fields.get(
        compiled,
        "loss",
        "compile.loss",
        "a JSON object or null",
        lambda v: v is None or isinstance(v, dict),
    )
    if loss is not None:
        _check_entry(fields, loss, "compile.loss", "loss")
    metrics = fields.get(
        compiled, "metrics", "compile.metrics", "a list", lambda v: isinstance(v, list)
    )
    for i, entry in enumerate(metrics):
        _check_entry(fields, entry, f"compile.metrics[{i}]", "metric")
    positive = "a positive int"
    fields.get(
        compiled,
        "steps_per_execution",
        "compile.steps_per_execution",
        positive,
        lambda v: is_int(v) and v >= 1,
    )
    fields.get(
        compiled,
        "gradient_accumulation_steps",
        "compile.gradient_accumulation_steps",
        positive,
        lambda v: is_int(v) and v >= 1,
        default=1,
    )
    fields.get(
        compiled,
        "sync_batch_norm",
        "compile.sync_batch_norm",
        '"global" or "per_replica"',
        lambda v: v in ("global", "per_replica"),
        default="global",
    )
    weighted = fields.get(
        compiled,
        "weighted_metrics",
        "compile.weighted_metrics",
        "a list",
        lambda v: isinstance(v, list),
        default=[],
    )
    for i, entry in enumerate(weighted):
        _check_entry(fields, entry, f"compile.weighted_metrics[{i}]", "metric")
    outputs = fields.get(
        compiled,
        "outputs",
        "compile.outputs",
        "a JSON object or null",
        lambda v: v is None or isinstance(v, dict),
        default=None,
    )
    if outputs is not None:
        _check_outputs(fields, outputs)
    fields.get(
        compiled,
        "remat",
        "compile.remat",
        f"null, {CUSTOM!r} or a checkpoint policy's name",
        lambda v: v is None or v == CUSTOM or v in remat_lib.POLICY_NAMES,
        default=None,
    )


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _check_outputs(fields: _Fields, outputs: dict[str, Any]) -> None:
    """A multi-output functional model's ``compile.outputs``: dicts by output name."""
    for name, entry in fields.get(
        outputs, "loss", "compile.outputs.loss", "an object", _is_dict
    ).items():
        _check_entry(fields, entry, f"compile.outputs.loss.{name}", "loss")
    fields.get(
        outputs,
        "loss_weights",
        "compile.outputs.loss_weights",
        "an object of numbers",
        lambda v: _is_dict(v) and all(isinstance(w, (int, float)) for w in v.values()),
    )
    for field in ("metrics", "weighted_metrics"):
        where = f"compile.outputs.{field}"
        lists = fields.get(
            outputs,
            field,
            where,
            "an object of lists",
            lambda v: _is_dict(v) and all(isinstance(e, list) for e in v.values()),
        )
        for name, entries in lists.items():
            for i, entry in enumerate(entries):
                _check_entry(fields, entry, f"{where}.{name}[{i}]", "metric")


def read_config(path: str) -> dict[str, Any]:
    """The configuration in ``path/jstrategy_model.json``, checked field by field.

    Raises:
      ValueError: naming the file and the field, for a file that is not JSON, not a
        JSON object, of another format or version, or with a field missing or of
        another type.
    """
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{file} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); it "
            f"was cut short or edited. {_FIX}"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e.reason}). {_FIX}") from None
    fields = _Fields(file)
    if not isinstance(config, dict):
        raise ValueError(
            f"{file} must hold a JSON object (the model's configuration); got a "
            f"{type(config).__name__}: {_shown(config)}. {_FIX}"
        )
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(
            f"{file} describes format {config.get('format')!r} version "
            f"{config.get('version')!r}; this jstrategy reads {FORMAT!r} version {VERSION}."
        )
    fields.string(config, "module", "module")
    fields.string(config, "name", "name")
    fields.get(
        config,
        "class_name",
        "class_name",
        "the saved model's class name",
        lambda v: isinstance(v, str),
        default="Model",
    )
    fields.get(config, "input_shape", "input_shape", "a list of sizes or null", _is_shape)
    fields.get(config, "input_dtype", "input_dtype", "a NumPy dtype name", _is_dtype)
    _check_sample_row(fields, config)
    _check_layers(fields, config)
    fields.get(config, "seed", "seed", "an int", is_int)
    fields.get(
        config,
        "train_arg",
        "train_arg",
        "a string or null",
        lambda v: v is None or isinstance(v, str),
    )
    fields.get(
        config,
        "dtype_policy",
        "dtype_policy",
        "a policy name",
        lambda v: isinstance(v, str),
        default="float32",
    )
    compiled = fields.get(
        config,
        "compile",
        "compile",
        "a JSON object or null (not compiled)",
        lambda v: v is None or isinstance(v, dict),
    )
    if compiled is not None:
        _check_compile(fields, compiled)
    return config


#: The model classes saved as a list of layers (`load_model` takes the layers for them).
_OF_LAYERS = ("Sequential", "Functional")


def check_module(
    config: dict[str, Any], module: Any, path: str, *, allow_other_module: bool
) -> None:
    """Refuses a `module` of another class than the saved one (unless allowed).

    The variables of two modules with the same layout (a ReLU and a tanh network) load
    into either one; the class is what tells them apart.

    Raises:
      ValueError: if the classes differ and `allow_other_module` is False.
    """
    check_bool(
        allow_other_module, "allow_other_module", "", expected="True or False", error=TypeError
    )
    layers = _given_layers(module)
    if layers is not None:
        _check_layer_classes(config, layers, path, allow_other_module=allow_other_module)
        return
    if config.get("class_name") in _OF_LAYERS:
        raise ValueError(
            f"{os.path.join(path, CONFIG_FILE)}: `class_name` says the model is a "
            f"jstrategy.{config['class_name']}, but load_model got a {type(module).__name__}. "
            "Pass its layers: load_model(path, [layer, ...]) (new layers of the saved "
            "classes, in the saved order), or nothing when their config was saved: "
            "load_model(path)."
        )
    saved, given = config["module"], type(module).__name__
    if saved == given or allow_other_module:
        return
    raise ValueError(
        f"{os.path.join(path, CONFIG_FILE)}: `module` says the model was saved from a "
        f"{saved}, but load_model got a {given}. Its variables may fit a {given} and "
        f"compute something else. Pass a {saved} of the saved architecture, or "
        f"allow_other_module=True if the {given} is meant to take them (e.g. the class "
        f"was renamed)."
    )


def _given_layers(module: Any) -> list[Any] | None:
    """The layers `load_model` was given for a `Sequential` (a list, or a `Sequential`
    whose ``layers`` they are), or None for a module."""
    if isinstance(module, (list, tuple)):
        return [symbolic.input_layer_of(layer) for layer in module]
    if isinstance(module, nn.Module):  # a Flax module, Flax's own nn.Sequential included
        return None
    layers = getattr(module, "layers", None)
    if type(module).__name__ in _OF_LAYERS and isinstance(layers, list):
        return list(module.layers)
    return None


def _check_layer_classes(
    config: dict[str, Any], layers: list[Any], path: str, *, allow_other_module: bool
) -> None:
    """Refuses layers for a model that is not a `Sequential`, or of other classes than the
    saved layers (``layer_classes``), unless allowed."""
    file = os.path.join(path, CONFIG_FILE)
    if config.get("class_name", "Model") not in _OF_LAYERS:
        raise ValueError(
            f"{file}: `class_name` says the model is a {config.get('class_name', 'Model')} "
            f"of a {config['module']} module, but load_model got a list of layers (the "
            f"route for a jstrategy.Sequential or a functional model). Pass the module: load_model(path, "
            f"{config['module']}(...))."
        )
    saved = config.get("layer_classes")
    # An Input given first describes the rows; the model's layers follow it.
    given = [serialization.class_name(layer) for layer in layers]
    if config.get("class_name") == "Sequential" and given[:1] == ["jstrategy.layers.InputLayer"]:
        given = given[1:]
    if saved is None or saved == given or allow_other_module:
        return
    raise ValueError(
        f"{file}: `layer_classes` says the {config['class_name']} was saved with layers {saved}, but "
        f"load_model got {given}. Pass new layers of the saved classes, in the saved order, "
        "or allow_other_module=True if these are meant to take the saved variables."
    )


# Building the compile arguments ----------------------------------------------------------
def _custom(
    entry: dict[str, Any], custom_objects: Mapping[str, Any], what: str, field: str, file: str
) -> Any:
    name = entry["name"]
    if name not in custom_objects:
        raise ValueError(
            f"{file}: `{field}` is the {what} {name!r}, which jstrategy does not define (a "
            f"function, an optax transformation or your own class), so it was saved by "
            f"name. Pass it to load_model: custom_objects={{{name!r}: ...}}."
        )
    return custom_objects[name]


def _registered(entry: dict[str, Any], kind: str, field: str, file: str) -> Any:
    cls = saved_class(
        kind,
        entry["class_name"],
        lambda known: (
            f"{file}: `{field}.class_name` must name a {kind} class jstrategy "
            f"saves, one of {known}, or be {CUSTOM!r} (with custom_objects); got "
            f"{entry['class_name']!r}. {_FIX}"
        ),
    )
    try:
        return cls(**entry["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{file}: `{field}.config` does not build a {cls.__name__}: {e} {_FIX}"
        ) from e


def _loss(entry: dict[str, Any], custom_objects: Mapping[str, Any], field: str, file: str) -> Any:
    if entry["class_name"] == CUSTOM:
        return _custom(entry, custom_objects, "loss", field, file)
    return _registered(entry, "loss", field, file)


def _metric(
    entry: dict[str, Any], loss: Any, custom_objects: Mapping[str, Any], field: str, file: str
) -> Any:
    if "identifier" in entry:
        return metrics_lib.get(entry["identifier"], loss=loss)
    if entry["class_name"] == CUSTOM:
        obj = _custom(entry, custom_objects, "metric", field, file)
        if "direction" in entry and not isinstance(obj, (metrics_lib.Metric, type)):
            # A function was wrapped: again, under the name it was saved (and logged) by.
            return metrics_lib.MeanMetricWrapper(
                obj, name=entry["name"], direction=entry["direction"]
            )
        return obj
    if entry["class_name"] == "MeanMetricWrapper":
        fn = _loss(entry["loss"], custom_objects, f"{field}.loss", file)
        try:
            return metrics_lib.MeanMetricWrapper(fn, **entry["config"])
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"{file}: `{field}.config` does not build a MeanMetricWrapper: {e} {_FIX}"
            ) from e
    return _registered(entry, "metric", field, file)


def _optimizer(entry: dict[str, Any], custom_objects: Mapping[str, Any], file: str) -> Any:
    if entry["class_name"] == CUSTOM:
        return _custom(entry, custom_objects, "optimizer", "compile.optimizer", file)
    try:
        return optimizer_serialization.deserialize(entry)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: `compile.optimizer`: {e} {_FIX}") from e


def compile_arguments(compiled: dict[str, Any], custom_objects: Any, path: str) -> dict[str, Any]:
    """The keyword arguments of `Model.compile` that a saved ``compile`` section (read by
    `read_config` from the directory `path`) describes.

    Raises:
      TypeError: if `custom_objects` is not a mapping of names.
      ValueError: naming the file and the field, for a class that is not registered, a
        config its class does not take, or a custom object `custom_objects` lacks.
    """
    if custom_objects is None:
        custom_objects = {}
    if not isinstance(custom_objects, Mapping) or not all(
        isinstance(k, str) for k in custom_objects
    ):
        raise TypeError(
            f"`custom_objects` must be a dict from the names the saved model uses to "
            f"objects, e.g. {{'my_loss': my_loss}}; got {_shown(custom_objects)}."
        )
    file = os.path.join(path, CONFIG_FILE)
    loss = compiled["loss"]
    if loss is not None:
        loss = _loss(loss, custom_objects, "compile.loss", file)
    metrics = [
        _metric(entry, loss, custom_objects, f"compile.metrics[{i}]", file)
        for i, entry in enumerate(compiled["metrics"])
    ]
    outputs = compiled.get("outputs")
    extra: dict[str, Any] = {}
    if outputs is not None:  # a multi-output functional model: by output name
        loss = {
            k: _loss(e, custom_objects, f"compile.outputs.loss.{k}", file)
            for k, e in outputs["loss"].items()
        }
        extra["loss_weights"] = dict(outputs["loss_weights"])
        for field in ("metrics", "weighted_metrics"):
            extra[field] = {
                k: [
                    _metric(
                        e, loss.get(k), custom_objects, f"compile.outputs.{field}.{k}[{i}]", file
                    )
                    for i, e in enumerate(entries)
                ]
                for k, entries in outputs[field].items()
            }
    return {
        "optimizer": _optimizer(compiled["optimizer"], custom_objects, file),
        "loss": loss,
        "metrics": metrics,
        "steps_per_execution": int(compiled["steps_per_execution"]),
        "gradient_accumulation_steps": int(compiled.get("gradient_accumulation_steps", 1)),
        "sync_batch_norm": compiled.get("sync_batch_norm", "global"),
        "weighted_metrics": [
            _metric(entry, loss, custom_objects, f"compile.weighted_metrics[{i}]", file)
            for i, entry in enumerate(compiled.get("weighted_metrics", []))
        ],
        "remat": _remat(compiled.get("remat"), custom_objects, file),
        **extra,
    }


def _remat(name: Any, custom_objects: Mapping[str, Any], file: str) -> Any:
    """The saved ``remat``: a policy's name as it is; a policy of your own (saved as
    ``"custom"``: it is code) given back by ``custom_objects={"remat": policy}``."""
    if name != CUSTOM:
        return name
    if "remat" not in custom_objects:
        raise ValueError(
            f"{file}: `compile.remat` was a checkpoint policy of your own (e.g. "
            "jax.checkpoint_policies.save_only_these_names(...)), which is code and is not "
            "saved. Pass it again: load_model(..., custom_objects={'remat': policy})."
        )
    return custom_objects["remat"]
