"""Keras's ``keras.utils`` array helpers: `to_categorical` and `normalize`, on NumPy arrays.

The numbers are Keras 3's (``keras/src/utils/numerical_utils.py``): a one-hot matrix with
the class axis last (a trailing axis of size 1 dropped first), float64 as Keras 3 returns,
and an L-p normalization that leaves zero rows as they are. Where Keras would silently
wrap a negative label to the last class or truncate 1.5 to class 1, these raise instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jstrategy._src.validation import check_positive_int

__all__ = ["normalize", "to_categorical"]


def to_categorical(x: Any, num_classes: int | None = None, dtype: Any = "float64") -> np.ndarray:
    """A class vector (ints) as a binary class matrix, as Keras's ``to_categorical``.

    Args:
      x: class indices (an array-like of ints in ``[0, num_classes)``); a trailing axis
        of size 1 (labels shaped ``(n, 1)``) is dropped, as Keras does.
      num_classes: the number of classes; None infers ``max(x) + 1``.
      dtype: the result's dtype. Keras 3 returns float64 (its default here); tf.keras's
        ``dtype="float32"`` argument is taken too.

    Returns:
      A NumPy array of shape ``x.shape + (num_classes,)`` (the trailing 1 dropped).

    Raises:
      ValueError: for labels that are not whole numbers, labels outside
        ``[0, num_classes)``, or a `num_classes` that is not a positive int.

    Example:

    >>> to_categorical([0, 2, 1], num_classes=3)
    array([[1., 0., 0.],
           [0., 0., 1.],
           [0., 1., 0.]])
    >>> to_categorical(np.array([[1], [0]])).shape
    (2, 2)
    """
    values = np.asarray(x)
    if values.dtype.kind not in "biuf" or (
        values.dtype.kind == "f" and not np.array_equal(values, np.round(values))
    ):
        raise ValueError(
            f"`x` must hold class indices (whole numbers); got an array of dtype "
            f"{values.dtype}{' with fractions' if values.dtype.kind == 'f' else ''}. Pass "
            "integer labels, e.g. to_categorical(np.asarray(y, np.int64))."
        )
    labels = values.astype(np.int64)
    shape = labels.shape
    if len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    labels = labels.reshape(-1)
    if num_classes is None or num_classes == 0:  # Keras: `if not num_classes`
        num_classes = int(np.max(labels, initial=-1)) + 1
    else:
        num_classes = check_positive_int(num_classes, "num_classes", "E.g. num_classes=10.")
    outside = labels[(labels < 0) | (labels >= num_classes)]
    if outside.size:
        bad = outside[0]
        raise ValueError(
            f"`x` holds the label {int(bad)}, outside [0, num_classes) = [0, {num_classes}). "
            "Pass num_classes greater than the largest label, or map the labels to "
            "0..num_classes-1 first."
        )
    categorical = np.zeros((labels.size, num_classes), dtype=dtype)
    categorical[np.arange(labels.size), labels] = 1
    return categorical.reshape((*shape, num_classes))


def normalize(x: Any, axis: int = -1, order: int = 2) -> np.ndarray:
    """`x` divided by its L-`order` norm along `axis`, as Keras's ``normalize`` (zero
    norms are left as they are).

    Example:

    >>> normalize(np.array([[3.0, 4.0], [0.0, 0.0]]))
    array([[0.6, 0.8],
           [0. , 0. ]])
    """
    x = np.asarray(x)
    norm = np.atleast_1d(np.linalg.norm(x, order, axis))
    norm[norm == 0] = 1
    return x / np.expand_dims(norm, axis or -1)
