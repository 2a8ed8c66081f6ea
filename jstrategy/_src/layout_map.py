"""`LayoutMap`: which variables are split over which mesh axes, Keras 3's semantics.

Keys are regular expressions matched with `re.search` against a variable's path joined by
``/`` (for Flax linen ``Dense_0/kernel``; the collection name ``params/`` is not part of
it); values say, per dimension of the variable, the mesh axes that split it: a tuple of
axis names or None per dimension, or a `jax.sharding.PartitionSpec`. A variable that no
key matches is replicated; a path that two keys match is an error naming both.
"""

from __future__ import annotations

import collections.abc
import math
import re
from collections.abc import Iterator
from typing import Any

from jax.sharding import PartitionSpec as P

from jstrategy._src.mesh import DeviceMesh

__all__ = ["NNX_VALUE", "LayoutMap", "matches_path", "misfit"]

#: The last key of an NNX variable's path in its state (the variable's ``value``).
NNX_VALUE = "value"


class LayoutMap(collections.abc.MutableMapping):
    """A dict from path regexes to layouts, as `keras.distribution.LayoutMap`.

    Setting a key checks its layout against the mesh at once: each entry must be None, a
    mesh axis name, or a tuple of axis names (a dimension split over several axes), and an
    axis may appear once per layout. Looking a path up (``layout_map[path]``) returns the
    layout of the key equal to `path`, else of the one key whose regex `re.search` finds in
    it, else None.

    Args:
      device_mesh: the `DeviceMesh` whose axes the layouts name.

    Raises:
      TypeError: if `device_mesh` is not a `DeviceMesh`.

    Example:

    >>> import jstrategy
    >>> mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    >>> layout_map = jstrategy.experimental.LayoutMap(mesh)
    >>> layout_map["Dense_0/kernel"] = (None, "model")
    >>> layout_map[".*Dense_1.*kernel"] = ("model", None)
    >>> layout_map["Dense_1/kernel"]
    P('model', None)
    >>> layout_map["Dense_1/bias"] is None
    True
    """

    def __init__(self, device_mesh: DeviceMesh):
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"`device_mesh` must be a jstrategy.experimental.DeviceMesh; got "
                f"{type(device_mesh).__name__} {device_mesh!r}. Build one with "
                "DeviceMesh(shape, axis_names)."
            )
        self._device_mesh = device_mesh
        self._layouts: dict[str, P] = {}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh whose axes the layouts name."""
        return self._device_mesh

    def __getitem__(self, key: str) -> P | None:
        """The layout for variable path `key`: exact key first, then the one regex match.

        Raises:
          ValueError: if several keys' regexes match `key`.
        """
        return self.lookup(key)[1]

    def lookup(self, path: str) -> tuple[str | None, P | None]:
        """``(key, layout)`` for variable path `path`; ``(None, None)`` when none matches.

        Args:
          path: the variable's path joined by ``/``, e.g. ``"Dense_0/kernel"``.

        Returns:
          The matching key and its layout.

        Raises:
          ValueError: if several keys' regexes match `path` (the message names them).
        """
        # An NNX variable's path is also written with its ``/value`` (as an NNX state's
        # keys run): ``dense1/kernel/value`` names ``dense1/kernel``.
        spellings = (path, f"{path}/{NNX_VALUE}")
        for spelling in spellings:
            if spelling in self._layouts:
                return spelling, self._layouts[spelling]
        matches = [key for key in self._layouts if matches_path(key, path)]
        if len(matches) > 1:
            raise ValueError(
                f"Path {path!r} matches several LayoutMap keys: {matches}. Each variable "
                "path must match at most one key; make the regexes more specific (e.g. "
                "anchor them with ^ and $)."
            )
        if matches:
            return matches[0], self._layouts[matches[0]]
        return None, None

    def __setitem__(self, key: str, layout: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(
                f"LayoutMap keys must be strings (regexes of variable paths such as "
                f"'Dense_0/kernel'); got {type(key).__name__} {key!r}."
            )
        if key in self._layouts:
            raise ValueError(
                f"Key {key!r} is already in the LayoutMap with layout {self._layouts[key]}. "
                "Delete it first (del layout_map[key]) to change its layout."
            )
        try:
            re.compile(key)
        except re.error as error:
            raise ValueError(f"LayoutMap key {key!r} is not a valid regex: {error}.") from None
        self._layouts[key] = _to_spec(key, layout, self._device_mesh)

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __contains__(self, key: object) -> bool:
        return key in self._layouts

    def __len__(self) -> int:
        return len(self._layouts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __repr__(self) -> str:
        return f"LayoutMap({self._device_mesh!r}, {self._layouts!r})"


def matches_path(key: str, path: str) -> bool:
    """Whether LayoutMap key `key` (a regex) matches the variable at `path` (as users write
    it, ``dense1/kernel``), also when the key spells an NNX variable with its ``/value``.

    Example:

    >>> matches_path("dense1/kernel/value", "dense1/kernel"), matches_path("kernel", "dense1/bias")
    (True, False)
    """
    return any(re.search(key, p) for p in (path, f"{path}/{NNX_VALUE}"))


def _to_spec(key: str, layout: Any, mesh: DeviceMesh) -> P:
    """The layout as a `PartitionSpec`, every axis checked against `mesh`."""
    if not isinstance(layout, (P, tuple, list)):
        raise TypeError(
            f"The layout for {key!r} must be a tuple with one entry per dimension (a mesh "
            f"axis name, a tuple of them, or None), e.g. (None, 'model'), or a "
            f"jax.sharding.PartitionSpec; got {type(layout).__name__} {layout!r}."
        )
    entries: list[str | tuple[str, ...] | None] = []
    used: list[str] = []
    for entry in layout:
        names = (entry,) if isinstance(entry, str) else entry
        if entry is None or (isinstance(entry, (tuple, list)) and not entry):
            entries.append(None)
            continue
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"The layout for {key!r} has entry {entry!r}; each entry must be a mesh axis "
                "name, a tuple of axis names, or None."
            )
        for name in names:
            if name not in mesh.axis_names:
                raise ValueError(
                    f"The layout for {key!r} names mesh axis {name!r}, which the mesh lacks; "
                    f"its axes are {mesh.axis_names}. Use one of them, or None to keep that "
                    "dimension whole."
                )
            if name in used:
                raise ValueError(
                    f"The layout for {key!r} uses mesh axis {name!r} twice ({layout!r}); an "
                    "axis can split one dimension only."
                )
            used.append(name)
        entries.append(names[0] if len(names) == 1 else tuple(names))
    return P(*entries)


def misfit(
    layout: P, shape: tuple[int, ...], mesh_shape: collections.abc.Mapping[str, int]
) -> str | None:
    """Why `layout` cannot lay out an array of `shape` on a mesh of `mesh_shape` (axis
    sizes by name); None when it can.

    Example:

    >>> print(misfit(P(None, "model"), (4, 6), {"model": 4}))
    dimension 1 (6) does not divide by 4, the size of mesh axis 'model'
    >>> misfit(P("model"), (8, 6), {"model": 4}) is None
    True
    """
    if len(layout) > len(shape):
        return f"the layout has {len(layout)} entries but the variable {len(shape)} dimensions"
    for dim, entry in enumerate(layout):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        size = math.prod(mesh_shape[a] for a in axes)
        if shape[dim] % size:
            which = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
            return f"dimension {dim} ({shape[dim]}) does not divide by {size}, the size of {which}"
    return None
