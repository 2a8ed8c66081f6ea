"""Argument validators with one home, so every bad argument gets the same kind of message.

Each names the argument, what was expected and what was given, and appends the caller's
fix, e.g. "`batch_size` must be a positive int; got 0. E.g. 32."
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "check_bool",
    "check_non_negative_int",
    "check_positive_float",
    "check_positive_int",
    "check_row_shape",
    "is_int",
    "named_object",
]


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or NumPy integer (a bool is not).

    Example:

    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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
    if not is_int(value) or value < 1:
        raise _fail(name, "a positive int", value, fix)
    return int(value)


def check_non_negative_int(value: Any, name: str, fix: str = "") -> int:
    """`value` as an int if it is an integer >= 0, else a `ValueError` naming `name`.

    Example:

    >>> check_non_negative_int(-1, "epochs")
    Traceback (most recent call last):
    ...
    ValueError: `epochs` must be a non-negative int; got -1.
    """
    if not is_int(value) or value < 0:
        raise _fail(name, "a non-negative int", value, fix)
    return int(value)


def check_positive_float(value: Any, name: str, fix: str = "") -> float:
    """`value` as a float if it is a number > 0 (not a bool), else a `ValueError`.

    Example:

    >>> check_positive_float(2, "timeout")
    2.0
    """
    number = isinstance(value, (int, float, np.integer, np.floating))
    if isinstance(value, bool) or not number or not value > 0:
        raise _fail(name, "a positive float", value, fix)
    return float(value)


def check_bool(value: Any, name: str, fix: str = "Pass True or False.") -> bool:
    """`value` if it is a bool, else a `ValueError` naming `name`.

    Example:

    >>> check_bool("yes", "from_logits")
    Traceback (most recent call last):
    ...
    ValueError: `from_logits` must be a bool; got 'yes'. Pass True or False.
    """
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value, fix)
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
    if isinstance(identifier, str):
        if identifier in by_name:
            return by_name[identifier]()
        raise ValueError(
            f"`{argument}` must be a {kind} name ({sorted(by_name)}), a {namespace} object or "
            f"None; got {identifier!r}."
        )
    if callable(identifier):
        return identifier
    raise ValueError(
        f"`{argument}` must be a {kind} name, a {namespace} object (e.g. {example}) or None; "
        f"got {type(identifier).__name__} {identifier!r}."
    )
