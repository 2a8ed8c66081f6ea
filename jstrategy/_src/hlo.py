"""Counting the collectives of a compiled program, by kind and by the mesh axes they span;
and its peak in device memory.

What a sharded strategy communicates is XLA's decision (its SPMD partitioner and
collective passes); the tests and `benchmarks/sharded_step.py` read it back from the
compiled HLO text (``jitted.lower(...).compile().as_text()``) with `collective_counts`.
`device_memory_peak` is the compiled program's memory analysis counting device memory only
(arguments and outputs the program keeps in host memory left out).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
from jax.sharding import Mesh

__all__ = [
    "COLLECTIVES",
    "collective_counts",
    "collective_groups",
    "device_arguments_bytes",
    "device_memory_peak",
    "host_memory_bytes",
    "permute_bytes",
    "permute_pairs",
]

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


def permute_bytes(hlo_text: str) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each collective-permute of compiled HLO text as ``(bytes of the array each source
    sends, its (source, target) device pairs)`` (`permute_pairs`' pairs).

    A pair whose source is its target moves nothing between devices; bytes sent per
    device, averaged over `n` devices, are ``sum(size * moving pairs) / n``.

    Example:

    >>> text = "%p = f32[4] collective-permute(f32[4] %k), source_target_pairs={{0,1},{1,1}}"
    >>> permute_bytes(text)
    [(16, [(0, 1), (1, 1)])]
    """
    found = []
    for line in hlo_text.splitlines():
        match = _OPS["collective-permute"].search(line)
        pairs = _PAIRS.search(line)
        if match is None or pairs is None:
            continue
        # The result's type: between "= " and the instruction's name.
        result = line[line.index("=") + 1 : match.start()]
        size = sum(n for n, _ in _arrays(result))
        found.append(
            (size, [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))])
        )
    return found


# Host memory in compiled HLO ---------------------------------------------------------------
#: XLA's memory space of host memory in a layout (``f32[128,64]{1,0:S(5)}``).
_HOST_SPACE = "S(5)"
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](?:\{([^}]*)\})?")  # scalars: no layout
_ALIAS = re.compile(r"\{(\d*)\}: \((\d+), \{\}")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def _arrays(text: str) -> list[tuple[int, bool]]:
    """``(bytes, in host memory)`` of each array type in `text`, in order."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        size = _DTYPE_BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
        out.append((size * math.prod(int(d) for d in dims.split(",") if d), _HOST_SPACE in layout))
    return out


def _braced(text: str, key: str) -> str | None:
    """What follows ``key{`` in `text` up to its matching ``}``, or None without `key`."""
    start = text.find(key + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(key)
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin + 1 : i]
    return None


def host_memory_bytes(hlo_text: str) -> tuple[int, int, int]:
    """Bytes of a compiled program's arguments, outputs and aliased (donated) outputs that
    its entry layout keeps in host memory, per device.

    XLA marks them in the compiled module's ``entry_computation_layout`` with memory space
    ``S(5)``, on every backend, including CPU devices, whose memory analysis counts them
    with the device's.

    Example:

    >>> text = (
    ...     "HloModule m, input_output_alias={ {1}: (1, {}, may-alias) }, "
    ...     "entry_computation_layout={(f32[4]{0}, f32[8,2]{1,0:S(5)})->(f32[4]{0}, "
    ...     "f32[8,2]{1,0:S(5)})}"
    ... )
    >>> host_memory_bytes(text)
    (64, 64, 64)
    """
    header = hlo_text.split("\n", 1)[0]
    layout = _braced(header, "entry_computation_layout=")
    if layout is None:
        return 0, 0, 0
    params_text, _, outputs_text = layout.partition(")->")
    params, outputs = _arrays(params_text), _arrays(outputs_text)
    aliased = 0
    for output, _param in _ALIAS.findall(_braced(header, "input_output_alias=") or ""):
        nbytes, host = outputs[int(output) if output else 0]
        aliased += nbytes if host else 0
    return (
        sum(n for n, host in params if host),
        sum(n for n, host in outputs if host),
        aliased,
    )


def device_memory_peak(compiled: Any) -> int:
    """A compiled program's peak per device in device memory: arguments + temporaries +
    outputs - aliased (donated) bytes, from XLA's ``memory_analysis()``, without what it
    keeps in host memory.

    A backend that reports host memory apart (``host_argument_size_in_bytes``...) has it
    left out already; on others (CPU devices) the bytes `host_memory_bytes` reads from the
    compiled module's entry layout are taken out.
    """
    m = compiled.memory_analysis()
    host_arguments, host_outputs, host_aliased = _host_parts(compiled)
    peak = (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )
    return int(peak - host_arguments - host_outputs + host_aliased)


def device_arguments_bytes(compiled: Any) -> int:
    """The bytes of a compiled program's arguments in device memory, per device (as
    `device_memory_peak` counts them)."""
    return int(compiled.memory_analysis().argument_size_in_bytes - _host_parts(compiled)[0])


def _host_parts(compiled: Any) -> tuple[int, int, int]:
    """`host_memory_bytes` of `compiled`, or zeros where the backend's memory analysis
    leaves host memory out itself."""
    m = compiled.memory_analysis()
    reported = getattr(m, "host_argument_size_in_bytes", 0) + getattr(
        m, "host_output_size_in_bytes", 0
    )
    return (0, 0, 0) if reported else host_memory_bytes(compiled.as_text())
