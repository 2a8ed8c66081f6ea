"""The largest global batch a TPU chip fits, for the llama2-7B rows (issue 46, item 4).

``maxtext_compare.py --topology v5e:4x4 --largest-batch`` (`maxtext_topology.main` hands it
here): for each 7B row of `maxtext_topology.ROWS` (jstrategy's side only), the row's
strategy built over the named topology's compile-only devices instead of the row's own
(the same 16 chips, another chip), and `jstrategy.experimental.plan(...,
find_largest_batch=True, device_memory=<the chip's HBM>)`. Printed per row: the chip, the
precision, the largest global batch (and per chip), the compiled peak at that batch (the
compiled program's ``memory_analysis()`` figure), the compiles the plan made and its wall
time; where not even the smallest batch fits, "does not fit", the figure (the TPU
compiler's where it refused the program for memory) and the plan's first advice.

``--verify`` compiles the step once more at the batch found (`plan` with
``find_largest_batch=False``) and checks that its peak is the search's figure for that
batch. Each (row, precision) plans in its own process (libtpu serves one a machine),
under ``flock`` with ``--lock``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import maxtext_compare as mc
import maxtext_topology as mt

#: The rows searched by default: the llama2-7B rows of one sequence a chip.
ROWS_7B = ("7b-fsdp", "7b-data-tensor", "7b-fsdp-tensor")
RESULT = "LARGEST-RESULT "


def chip_of(topology: str) -> str:
    """``"v5e:4x4"`` -> ``"v5e"``, checked against the chips whose HBM is known."""
    chip = topology.split(":")[0]
    if chip not in mt.HBM:
        raise SystemExit(f"--topology {topology!r}: chip {chip!r} has no HBM figure; known: "
                         + ", ".join(f"{k} ({v / 2**30:.0f} GiB)" for k, v in mt.HBM.items()))  # fmt: skip
    return chip


def on_topology(row: mt.TopologyRow, topology: str) -> mt.TopologyRow:
    """`row` with its jstrategy side built over `topology`'s devices (as many chips)."""
    return dataclasses.replace(row, topology=topology)


def planned(row: mt.TopologyRow, precision: str, batch: int | None, search: bool) -> Any:
    """`plan` of the row's step over its topology's devices at `batch` (the row's)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jstrategy.experimental import plan

    strategy = mt.jstrategy_strategy(row)
    model = mc.Decoder(row.shape, layers="scanned")
    tokens = jax.ShapeDtypeStruct((batch or row.batch, row.shape.seq), jnp.int32)
    return plan(
        model, strategy, (tokens, tokens), optimizer=optax.adamw(mc.LEARNING_RATE, **mc.ADAMW),
        loss=mc.token_loss, remat=True, device_memory=mt.HBM[chip_of(row.topology)],
        dtype_policy=precision if precision != "float32" else None, find_largest_batch=search,
    )  # fmt: skip


def search_side(key: str, topology: str, precision: str, verify: bool) -> dict[str, Any]:
    """The child process: the search for one row, its figures as a dict."""
    row = on_topology(mt.ROWS[key], topology)
    start = time.perf_counter()
    report = planned(row, precision, None, search=True)
    seconds = time.perf_counter() - start
    print(report, flush=True)
    print("compiled (global batch, peak GiB):",
          [(b, round(p / 2**30, 2)) for b, p in report.batch_peaks], flush=True)  # fmt: skip
    result: dict[str, Any] = {
        "largest": report.largest_batch,
        "peak": report.largest_batch_peak,
        "compiles": report.compiles,
        "seconds": seconds,
        "caveat": report.largest_batch_caveat,
        "budget": report.device_memory,
        "peak_at_given": report.peak,
        "refused": None if report.compiler_refusal is None else report.compiler_refusal.message,
        "advice": [a.message for a in report.advice],
    }
    if verify and report.largest_batch:
        again = planned(row, precision, report.largest_batch, search=False)
        result["verified_peak"] = again.peak
    return result


def in_subprocess(key: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """One row's search in a child process (libtpu's one-process lock), its log kept."""
    command = [sys.executable, __file__, "--child", key, "--topology", args.topology,
               "--precision", precision] + (["--verify"] if args.verify else [])  # fmt: skip
    log = Path(args.log_dir) / f"largest-{args.topology.replace(':', '_')}-{key}-{precision}.log"
    return mt.run_logged(command, args.lock, log, RESULT)


HEADER = (
    "| row | chip (HBM) | precision | largest global batch (a chip) | compiled peak GiB/chip | "
    "compiles | wall s | note |\n|---|---|---|---|---|---|---|---|"
)


def format_row(row: mt.TopologyRow, precision: str, r: dict[str, Any]) -> str:
    chip = chip_of(row.topology)
    cells = [row.label, f"{row.topology} ({mt.HBM[chip] / 2**30:.0f} GiB)", precision]
    if "error" in r:
        return "| " + " | ".join([*cells, "-", "-", "-", "-", r["error"]]) + " |"  # no figures
    notes = []
    if r["largest"] is None:
        figure = f"{r['peak_at_given'] / 2**30:.2f} GiB at batch {row.batch}"
        refused = f"; the TPU compiler refused it: {r['refused']}" if r["refused"] else ""
        advice = f"; advice: {r['advice'][0]}" if r["advice"] else ""
        cells += ["does not fit", "-"]
        notes.append(f"{figure}{refused}{advice}")
    else:
        cells += [f"{r['largest']} ({r['largest'] / row.chips:g})", f"{r['peak'] / 2**30:.2f}"]
    if r.get("caveat"):
        notes.append(f"at least: {r['caveat']}")
    if "verified_peak" in r:
        same = "equal" if r["verified_peak"] == r["peak"] else "DIFFERENT"
        notes.append(f"recompiled at {r['largest']}: {r['verified_peak']:,} B ({same})")
    cells += [str(r["compiles"]), f"{r['seconds']:.0f}", "; ".join(notes)]
    return "| " + " | ".join(cells) + " |"


def main(args: argparse.Namespace) -> list[str]:
    """The table for ``--topology`` (`maxtext_topology.main`'s parsed arguments)."""
    if not args.topology:
        raise SystemExit("--largest-batch needs --topology, e.g. v5e:4x4 or v5p:2x2x4.")
    chip_of(args.topology)
    keys = args.rows or list(ROWS_7B)
    table = []
    for key in keys:
        row = on_topology(mt.ROWS[key], args.topology)
        for precision in args.precision:
            print(f"{row.label} on {args.topology}, {precision}: the largest batch", flush=True)
            table.append(format_row(row, precision, in_subprocess(key, precision, args)))
            print(table[-1], flush=True)
    print()
    print(HEADER)
    print("\n".join(table))
    return table


def _child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=sorted(mt.ROWS), required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--precision", choices=mt.PRECISIONS, required=True)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = search_side(args.child, args.topology, args.precision, args.verify)
    except Exception as error:  # a row's own failure is its note, not the run's end
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1:])
