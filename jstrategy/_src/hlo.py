"""Counting the collectives of a compiled program, by kind and by the mesh axes they span.

What a sharded strategy communicates is XLA's decision (its SPMD partitioner and
collective passes); the tests and `benchmarks/sharded_step.py` read it back from the
compiled HLO text (``jitted.lower(...).compile().as_text()``) with `collective_counts`.
"""

from __future__ import annotations

import math
import re

import numpy as np
from jax.sharding import Mesh

__all__ = ["COLLECTIVES", "collective_counts", "collective_groups", "permute_pairs"]

#: The collective instructions of XLA's HLO.
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

_OPS = {op: re.compile(rf"(?<![%\w.-]){op}(?:-start)?\(") for op in COLLECTIVES}
_LISTED = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)


def collective_counts(hlo_text: str, mesh: Mesh | None = None) -> dict[str, int]:
    """How many collectives of each kind compiled HLO text holds.

    An asynchronous pair (``all-gather-start`` / ``-done``) counts once. With `mesh`, each
    kind is further split by the mesh axes its replica groups span, e.g.
    ``"all-reduce[model]"``, ``"all-gather[replica]"`` (``"?"`` when the groups cannot be
    read).

    Args:
      hlo_text: the compiled module's text (``compiled.as_text()``).
      mesh: the mesh the program runs on, to name the axes; None to count by kind only.

    Returns:
      ``{kind or "kind[axes]": count}`` for the kinds present, sorted by key.

    Example:

    >>> text = "%ag = f32[8] all-gather(f32[1] %p), replica_groups={{0,1,2,3,4,5,6,7}}"
    >>> collective_counts(text)
    {'all-gather': 1}
    """
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        for op, pattern in _OPS.items():
            if pattern.search(line) is None:
                continue
            key = op if mesh is None else f"{op}[{_axes_of(line, mesh)}]"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def collective_groups(hlo_text: str) -> list[tuple[str, list[int] | None]]:
    """Each collective of compiled HLO text as ``(kind, its first replica group)``.

    The group's ids are positions in the program's device assignment (the mesh's devices
    in order, ``mesh.devices.flat``); None when the groups cannot be read. An asynchronous
    pair counts once.

    Example:

    >>> collective_groups("%a = f32[8] all-reduce(f32[8] %x), replica_groups=[2,4]<=[8]")
    [('all-reduce', [0, 1, 2, 3])]
    """
    found = []
    for line in hlo_text.splitlines():
        for op, pattern in _OPS.items():
            if pattern.search(line) is not None:
                found.append((op, _first_group(line)))
    return found


def _first_group(line: str) -> list[int] | None:
    """The device ids of the first replica group of a collective's HLO line."""
    listed = _LISTED.search(line)
    if listed is not None:
        return [int(i) for i in listed.group(1).split(",")]
    mesh = _MESH.search(line)
    if mesh is not None:
        return _mesh_group(*mesh.groups())
    iota = _IOTA.search(line)
    if iota is None:
        return None
    # [groups, size]<=[dims]T(perm): an iota over `dims`, transposed, reshaped to groups.
    shape = [int(i) for i in iota.group(1).split(",")]
    dims = [int(i) for i in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
        ids = ids.transpose([int(i) for i in iota.group(3).split(",")])
    return ids.reshape(shape[0], -1)[0].tolist()


def _mesh_group(axes: str, dims: str | None, perm: str | None, over: str) -> list[int]:
    """The first group of XLA's mesh form: axes ``'a'=4,'b'=2``, the devices an iota over
    `dims` transposed by `perm` (default: in order), the collective over the axes `over`."""
    named = re.findall(r"'([^']+)'=(\d+)", axes)
    sizes = [int(size) for _, size in named]
    shape = [int(i) for i in dims.split(",")] if dims else sizes
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(i) for i in perm.split(",")])
    ids = ids.reshape(sizes)
    spans = set(re.findall(r"'([^']+)'", over))
    index = tuple(slice(None) if name in spans else 0 for name, _ in named)
    return ids[index].reshape(-1).tolist()


def _axes_of(line: str, mesh: Mesh) -> str:
    group = _first_group(line)
    if group is None:
        return "?"
    # Replica groups name positions in the program's device assignment: the mesh's devices
    # in mesh order.
    position = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    coords = [np.argwhere(position == i)[0] for i in group]
    varying = [
        str(name) for k, name in enumerate(mesh.axis_names) if len({int(c[k]) for c in coords}) > 1
    ]
    return ",".join(varying) or "-"


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def permute_pairs(hlo_text: str) -> list[list[tuple[int, int]]]:
    """The ``(source, target)`` device pairs of each collective-permute in compiled HLO text.

    Device ids are positions in the program's device assignment (the mesh's devices in
    order, ``mesh.devices.flat``); an asynchronous pair (``-start`` / ``-done``) counts once.

    Example:

    >>> text = "%p = f32[4] collective-permute(f32[4] %k), source_target_pairs={{0,1},{1,0}}"
    >>> permute_pairs(text)
    [[(0, 1), (1, 0)]]
    """
    found = []
    for line in hlo_text.splitlines():
        if _OPS["collective-permute"].search(line) is None:
            continue
        match = _PAIRS.search(line)
        if match is not None:
            pairs = re.findall(r"\{(\d+),(\d+)\}", match.group(1))
            found.append([(int(a), int(b)) for a, b in pairs])
    return found
