"""`ReduceOp`: how values from several replicas are combined."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


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
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"`reduce_op` must be a jstrategy.ReduceOp or one of {list(cls.__members__)}; "
            f"got {value!r}. Pass jstrategy.ReduceOp.SUM or jstrategy.ReduceOp.MEAN."
        )
