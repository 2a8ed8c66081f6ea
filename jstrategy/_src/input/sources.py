"""What a user's dataset is read through: `Source` opens fresh iterators over a
re-iterable, a zero-arg callable (a generator function), a one-shot iterator, a grain
loader or a `tf.data.Dataset`, and can peek at the first batch without losing it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jstrategy._src.validation import short_repr

__all__ = ["Source", "empty_error"]


class Source:
    """Opens fresh iterators over a user dataset: a re-iterable, a zero-arg callable, tf.data."""

    def __init__(self, dataset: Any, arg: str):
        self.arg = arg
        self.one_shot = False
        self._used = False
        self._peeked: tuple[Any, Iterator[Any]] | None = None
        if isinstance(dataset, (np.ndarray, jax.Array, dict, str, bytes)):
            raise TypeError(
                f"`{arg}` must be an iterable of global batches (a list, a generator function, "
                f"a grain loader, a tf.data.Dataset); got a {type(dataset).__name__}, which "
                "would be iterated row by row or key by key. Wrap a single batch in a list "
                "([batch]) or use distribute_batch."
            )
        as_numpy = getattr(dataset, "as_numpy_iterator", None)
        if callable(as_numpy):
            # tf.data: iterating the dataset itself yields tf.Tensors; NumPy is what we place.
            self._open = as_numpy
        elif isinstance(dataset, Iterable):
            if isinstance(dataset, Iterator):
                self.one_shot = True
            self._open = lambda: iter(dataset)
        elif callable(dataset):
            self._open = lambda: _iter_of(dataset(), arg)
        else:
            raise TypeError(
                f"`{arg}` must be an iterable of global batches or a zero-arg callable "
                f"returning an iterator; got {type(dataset).__name__} {short_repr(dataset)}."
            )
        self._dataset = dataset

    @property
    def length(self) -> int | None:
        try:
            return len(self._dataset)
        except TypeError:  # no __len__, or tf.data with unknown or infinite cardinality
            return None

    def open(self) -> Iterator[Any]:
        if self._peeked is not None:
            first, rest = self._peeked
            self._peeked = None
            self._used = True
            return itertools.chain([first], rest)
        if self.one_shot and self._used:
            raise ValueError(
                f"`{self.arg}` is an iterator (e.g. a generator object), which can be iterated "
                "only once, and it has been. Pass a re-iterable (a list, a tf.data.Dataset, a "
                "grain loader) or a zero-arg callable returning a fresh iterator (a generator "
                "function) to iterate again."
            )
        self._used = True
        return iter(self._open())

    def peek(self) -> Any:
        """The first batch, kept so the next `open` still yields it."""
        if self._peeked is None:
            it = self.open()
            try:
                first = next(it)
            except StopIteration:
                raise empty_error(self.arg) from None
            self._peeked = (first, it)
            self._used = False
        return self._peeked[0]


def _iter_of(obj: Any, arg: str) -> Iterator[Any]:
    if not isinstance(obj, Iterable):
        raise TypeError(
            f"`{arg}` was called as a zero-arg function and returned a "
            f"{type(obj).__name__}; it must return an iterator or iterable of batches (e.g. "
            "be a generator function)."
        )
    return iter(obj)


def empty_error(arg: str) -> ValueError:
    return ValueError(
        f"`{arg}` yielded no batches; expected at least one global batch (a pytree of "
        "arrays). Check that it is not empty or already consumed; a generator object can be "
        "iterated once only, so pass the generator function instead."
    )
