"""Argument validators with one home, so every bad argument gets the same kind of message.

Each names the argument, what was expected and what was given, and appends the caller's
fix, e.g. "`batch_size` must be a positive int; got 0. E.g. 32."
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "refuse_keras_3_object",
    "check_bool",
    "check_mode",
    "check_non_negative_int",
    "check_number",
    "check_positive_float",
    "check_positive_int",
    "check_row_shape",
    "is_int",
    "is_number",
    "named_object",
    "short_repr",
]


def check_mode(value: Any, mode: type[enum.Enum], name: str, fix: str) -> Any:
    """`value` (a member of the `mode` enum, or its value in any case) as a member; for any
    other, the `ValueError` naming `name`, the members, what was given and `fix`.

    Example:

    >>> import enum
    >>> class Shade(enum.Enum):
    ...     DARK = "dark"
    >>> check_mode("DARK", Shade, "shade", "Pass e.g. shade='dark'.")
    <Shade.DARK: 'dark'>
    """
    if isinstance(value, mode):
        return value
    names = [m.value for m in mode]
    if isinstance(value, str) and value.lower() in names:
        return mode(value.lower())
    raise ValueError(
        f"`{name}` must be one of {names} (or a jstrategy.experimental.{mode.__name__}); "
        f"got {value!r}. {fix}"
    )


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or NumPy integer (a bool is not).

    Example:

    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether `value` is a Python or NumPy real number (a bool is not).

    Example:

    >>> is_number(0.5), is_number(np.float32(2)), is_number(False), is_number("1")
    (True, True, False, False)
    """
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def short_repr(value: Any) -> str:
    """`value`'s repr cut to 40 characters, for naming a bad value in a message.

    Example:

    >>> short_repr((1, 2)), short_repr(list(range(20)))
    ('(1, 2)', '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11...')
    """
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expected(
    integer: bool,
    low: float | None,
    high: float | None,
    low_open: bool,
    high_open: bool,
    finite: bool,
) -> str:
    """What `check_number` wanted, in the words the library's messages use."""
    kind = "int" if integer else "float"
    if low is not None and high is not None:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        return f"{'an int' if integer else 'a float'} in {left}{low}, {high}{right}"
    if high is None and low == 0 and not low_open:
        return f"a non-negative {kind}"
    if high is None and ((low == 0 and low_open) or (integer and low == 1)):
        return f"a positive {'finite ' if finite else ''}{kind}"
    if finite:
        return f"a finite {kind}"
    return "an int" if integer else "a number"


def check_number(
    value: Any,
    name: str,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = False,
    expected: str | None = None,
    fix: str = "",
) -> Any:
    """`value` if it is a number (an integer with `integer`; never a bool) in the range,
    as an int or a float; else a `ValueError` naming `name`. The one numeric check.

    Args:
      value: what was given.
      name: the argument's name.
      integer: whether it must be an integer (Python or NumPy).
      low: the lowest value allowed (None: no bound); `low_open` excludes it.
      high: the highest value allowed (None: no bound); `high_open` excludes it.
      finite: whether infinities and NaN are refused.
      expected: what the message says was expected; by default from the other
        arguments (``"a positive int"``, ``"a float in [0, 1)"``, ...).
      fix: appended to the message.

    Example:

    >>> check_number(0.5, "rate", low=0, high=1, high_open=True)
    0.5
    >>> check_number(True, "momentum", low=0, high=1)
    Traceback (most recent call last):
    ...
    ValueError: `momentum` must be a float in [0, 1]; got True.
    >>> check_number(0, "steps", integer=True, low=1, fix="E.g. 100.")
    Traceback (most recent call last):
    ...
    ValueError: `steps` must be a positive int; got 0. E.g. 100.
    """
    ok = is_int(value) if integer else is_number(value)
    if ok and finite and not np.isfinite(value):
        ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if expected is None:
            expected = _expected(integer, low, high, low_open, high_open, finite)
        raise _fail(name, expected, value, fix)
    return int(value) if integer else float(value)


def _fail(name: str, expected: str, value: Any, fix: str) -> ValueError:
    shown = repr(value)
    if hasattr(value, "shape") and np.ndim(value) > 0:  # not a whole array's repr
        shown = f"an array of shape {np.shape(value)}"
    return ValueError(f"`{name}` must be {expected}; got {shown}. {fix}".rstrip())


def check_positive_int(value: Any, name: str, fix: str = "") -> int:
    """`value` as an int if it is an integer >= 1, else a `ValueError` naming `name`.

    Example:

    >>> check_positive_int(8, "steps_per_execution")
    8
    >>> check_positive_int(0, "batch_size", "E.g. 32.")
    Traceback (most recent call last):
    ...
    ValueError: `batch_size` must be a positive int; got 0. E.g. 32.
    """
    return check_number(value, name, integer=True, low=1, fix=fix)


def check_non_negative_int(value: Any, name: str, fix: str = "") -> int:
    """`value` as an int if it is an integer >= 0, else a `ValueError` naming `name`.

    Example:

    >>> check_non_negative_int(-1, "epochs")
    Traceback (most recent call last):
    ...
    ValueError: `epochs` must be a non-negative int; got -1.
    """
    return check_number(value, name, integer=True, low=0, fix=fix)


def check_positive_float(value: Any, name: str, fix: str = "") -> float:
    """`value` as a float if it is a number > 0 (not a bool), else a `ValueError`.

    Example:

    >>> check_positive_float(2, "timeout")
    2.0
    """
    return check_number(value, name, low=0, low_open=True, fix=fix)


def check_bool(
    value: Any,
    name: str,
    fix: str = "Pass True or False.",
    *,
    expected: str = "a bool",
    error: type[Exception] = ValueError,
) -> bool:
    """`value` if it is a bool, else an `error` (a `ValueError` by default) naming `name`.

    Example:

    >>> check_bool("yes", "from_logits")
    Traceback (most recent call last):
    ...
    ValueError: `from_logits` must be a bool; got 'yes'. Pass True or False.
    """
    if not isinstance(value, bool):
        raise error(str(_fail(name, expected, value, fix)))
    return value


def check_row_shape(value: Any, name: str) -> tuple[int, ...]:
    """`value` (an int or a sequence of ints) as the shape of one row, without the batch.

    A model builds its variables from one concrete row, so every dimension must be a
    positive int; a None (Keras's unknown dimension, often the batch axis written out)
    is refused with the fix.

    Example:

    >>> check_row_shape(10, "input_shape"), check_row_shape([28, 28, 1], "input_shape")
    ((10,), (28, 28, 1))
    >>> check_row_shape((None, 10), "input_shape")
    Traceback (most recent call last):
    ...
    ValueError: `input_shape` must be the shape of one row without the batch axis, every dimension a positive int; got (None, 10). Drop the batch dimension: input_shape=(10,).
    """
    if is_int(value):
        value = (value,)
    if isinstance(value, (tuple, list)) and all(is_int(d) and d > 0 for d in value):
        return tuple(int(d) for d in value)
    fix = "E.g. input_shape=(10,) for rows of 10 features."
    if isinstance(value, (tuple, list)) and value and value[0] is None:
        rest = tuple(value[1:])
        if all(is_int(d) and d > 0 for d in rest):
            fix = f"Drop the batch dimension: {name}={rest!r}."
    elif isinstance(value, (tuple, list)) and None in value:
        fix = "Variable-size dimensions are not supported: give the size of one row."
    raise _fail(
        name,
        "the shape of one row without the batch axis, every dimension a positive int",
        tuple(value) if isinstance(value, list) else value,
        fix,
    )


def named_object(
    identifier: Any, by_name: dict[str, Any], argument: str, kind: str, namespace: str, example: str
) -> Any:
    """Keras's way to give a layer an object: its name (built with its defaults), the
    object itself, any callable, or None.

    Example:

    >>> named_object("l2", {"l2": dict}, "kernel_regularizer", "regularizer", "", "")
    {}
    >>> named_object(3, {}, "kernel_constraint", "constraint", "jstrategy.constraints", "NonNeg()")
    Traceback (most recent call last):
    ...
    ValueError: `kernel_constraint` must be a constraint name, a jstrategy.constraints object (e.g. NonNeg()) or None; got int 3.
    """
    if identifier is None:
        return None
    return keras_object(
        identifier,
        by_name,
        None,
        lambda fn: fn,
        unknown=lambda known: (
            f"`{argument}` must be a {kind} name ({known}), a {namespace} "
            f"object or None; got {identifier!r}."
        ),
        bad=f"`{argument}` must be a {kind} name, a {namespace} object (e.g. {example}) or "
        f"None; got {type(identifier).__name__} {identifier!r}.",
    )


def refuse_keras_3_object(identifier: Any) -> None:
    """Raises for a Keras 3 object given where jstrategy's own is taken (`compile`'s loss,
    metrics or optimizer): it would be called as a plain function, and a Keras loss reduces
    to a scalar where the step needs per-example values. Duck-typed: imports no Keras.

    Raises:
      ValueError: naming the object and the adapter.

    Example:

    >>> refuse_keras_3_object("mse")  # anything not from Keras passes
    """
    module = type(identifier).__module__ or ""
    if module.split(".")[0] != "keras":
        return
    raise ValueError(
        f"{type(identifier).__name__} is a Keras 3 object ({module}); jstrategy's compile "
        "takes jstrategy's. Wrap it: jstrategy.keras.loss(keras_loss) or "
        "jstrategy.keras.optimizer(keras_optimizer); for a metric, jstrategy.metrics has "
        "Keras's metrics by name (e.g. metrics=['sparse_categorical_accuracy']). Or train "
        "the keras.Model with Keras's own fit inside strategy.scope()."
    )


def keras_object(
    identifier: Any,
    by_name: Mapping[str, Callable[[], Any]],
    base: type | None,
    wrap: Callable[[Any], Any],
    *,
    unknown: Callable[[list[str]], str],
    bad: str,
) -> Any:
    """Keras's ``get`` of an object: an instance of `base` as it is, a name (from
    `by_name`), a subclass of `base` (built with its defaults), or a function (`wrap`-ped).

    Args:
      identifier: what the user gave.
      by_name: the names known, each to what builds the object.
      base: the class of the objects, or None where any callable is one.
      wrap: makes an object of a function (a loss of ``fn(y_true, y_pred)``).
      unknown: the message for an unknown name, given the known names (sorted).
      bad: the message for an identifier of another type.

    Raises:
      ValueError: for an unknown name or an identifier of another type.

    Example:

    >>> keras_object("one", {"one": lambda: 1}, int, str, unknown=str, bad="")
    1
    >>> keras_object(len, {}, int, lambda fn: fn.__name__, unknown=str, bad="")
    'len'
    """
    refuse_keras_3_object(identifier)
    if base is not None and isinstance(identifier, base):
        return identifier
    if isinstance(identifier, str):
        if identifier in by_name:
            return by_name[identifier]()
        raise ValueError(unknown(sorted(by_name)))
    if base is not None and isinstance(identifier, type) and issubclass(identifier, base):
        return identifier()
    if callable(identifier):
        return wrap(identifier)
    raise ValueError(bad)
