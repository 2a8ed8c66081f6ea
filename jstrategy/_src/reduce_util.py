"""`ReduceOp`: how values from several replicas are combined."""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["ReduceOp", "enum_from_value"]

_E = TypeVar("_E", bound=enum.Enum)


def enum_from_value(cls: type[_E], value: _E | str, *, argument: str, fix: str = "") -> _E:
    """Coerces a member of `cls` or its name (any case) to the member, as TF accepts strings.

    Raises:
      ValueError: naming `argument`, the valid names and what was given.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    raise ValueError(
        f"`{argument}` must be a jstrategy.{cls.__name__} or one of "
        f"{list(cls.__members__)}; got {value!r}.{' ' + fix if fix else ''}"
    )


class ReduceOp(enum.Enum):
    """How `reduce` and `all_reduce` combine values across replicas.

    Strings are accepted wherever a `ReduceOp` is, as in tf.distribute:

    >>> ReduceOp.from_value("SUM") is ReduceOp.SUM
    True
    >>> ReduceOp.from_value("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: ReduceOp | str) -> ReduceOp:
        """Coerces `value` (a `ReduceOp` or its name) to a `ReduceOp`.

        Args:
          value: a `ReduceOp`, or one of the strings ``"SUM"`` and ``"MEAN"`` (any case).

        Returns:
          The matching `ReduceOp`.

        Raises:
          ValueError: if `value` names no `ReduceOp`.
        """
        return enum_from_value(
            cls,
            value,
            argument="reduce_op",
            fix="Pass jstrategy.ReduceOp.SUM or jstrategy.ReduceOp.MEAN.",
        )
