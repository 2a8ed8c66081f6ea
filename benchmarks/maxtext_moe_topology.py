"""A Mixtral-8x7B-shaped decoder's train step compiled for a TPU topology: per-chip peak,
jstrategy beside MaxText 0.2.5, no TPU needed (libtpu's compile-only devices).

The model is `_maxtext_moe`'s (benchmarks/maxtext_compare.py's decoder with each MLP a
mixture of SwiGLU experts, top-2, capacity factor 1.25, the same settings on both sides),
at Mixtral 8x7B's sizes: d 4096, 32 query heads and 8 key/value heads of 128, 8 experts of
MLP 14336, 32 layers (scanned), vocab 32000; sequence 4096 (``--seq``), global batch one
row a chip; float32 weights, activations and AdamW state on both sides, as the CPU rows.

* **jstrategy**: `jstrategy.experimental.plan` over ``FSDPStrategy(devices=
  topology_devices("v5p:2x2x4"), experts=k)`` with ``remat=True``: the train step
  compiled for the topology's 16 chips, its ``memory_analysis()`` read.
* **MaxText**: what its ``train_compile.py`` does (``compile_topology=v5p-32``, its
  ``get_topology_mesh``, ``get_shaped_inputs``, ``get_functional_train_with_signature``,
  ``jit_and_compile``: `maxtext_topology.maxtext_train_compile`, the dense rows' too), with ``_maxtext_moe.maxtext_overrides`` (``decoder_block=mixtral``,
  ``sparse_matmul=false``: its dense-matmul path, which drops tokens as jstrategy's does)
  and ``ici_expert_parallelism=k ici_fsdp_parallelism=16/k``; ``hardware=tpu``.

Both print their parameter count (checked against the formula) and the peak per chip
(arguments + temporaries + outputs - aliased). Needs libtpu; runs each side in this one
process when MaxText is importable (else jstrategy's only). libtpu allows one process per
machine: where others use it, run under ``flock``::

    flock /work/libtpu.lock env DECOUPLE_GCLOUD=TRUE PYTHONPATH=. \\
        /work/venvs/maxtext/bin/python benchmarks/maxtext_moe_topology.py --experts 1 8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host's devices; the topology's compile

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _maxtext_moe as moe
import maxtext_compare as mc
import maxtext_topology

import jstrategy
from jstrategy.experimental import plan
from jstrategy.experimental import topology_devices

HBM = 95 * 2**30  # a v5p chip's


def mixtral_8x7b(layers: int, seq: int) -> moe.MoEShape:
    return moe.MoEShape(layers, d_model=4096, heads=32, kv_heads=8, mlp=14336, vocab=32000,
                        seq=seq)  # fmt: skip


def jstrategy_row(shape: moe.MoEShape, topology: str, experts: int) -> dict[str, Any]:
    devices = topology_devices(topology)
    strategy = jstrategy.experimental.FSDPStrategy(devices=devices, experts=experts)
    batch = len(devices)
    tokens = jax.ShapeDtypeStruct((batch, shape.seq), jnp.int32)
    report = plan(moe.Decoder(shape, "scanned"), strategy, (tokens, tokens),
                  optimizer=optax.adamw(mc.LEARNING_RATE, **mc.ADAMW), loss=mc.token_loss,
                  remat=True, device_memory=HBM, find_largest_batch=False)  # fmt: skip
    print(report, flush=True)
    init = jax.eval_shape(moe.Decoder(shape, "scanned").init, jax.random.key(0), tokens)
    parameters = sum(leaf.size for leaf in jax.tree.leaves(init["params"]))
    return {"peak": report.peak, "parameters": parameters, "refused": report.compiler_refusal}


def maxtext_row(
    shape: moe.MoEShape, compile_topology: str, chips: int, experts: int
) -> dict[str, Any]:
    settings = dict(
        item.split("=", 1) for item in moe.maxtext_overrides(shape, "moe", "scanned", chips)
    )
    settings.pop("hardware")
    settings.update(
        compile_topology=compile_topology,
        compile_topology_num_slices="1",
        per_device_batch_size="1",
        ici_expert_parallelism=str(experts),
        ici_fsdp_parallelism=str(chips // experts),
    )
    parameters, compile_step = maxtext_topology.maxtext_train_compile(
        settings, "maxtext_moe_topology"
    )
    try:
        compiled = compile_step()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler's HBM check
        return {"peak": None, "parameters": parameters, "refused": str(e).splitlines()[0][:300]}
    memory = mc.analysed(compiled)
    print(
        "MaxText memory per chip (MiB):",
        {k: round(v / 2**20, 1) for k, v in memory.items()},
        flush=True,
    )
    peak = memory["arguments"] + memory["temporaries"] + memory["outputs"] - memory["aliased"]
    return {"peak": peak, "parameters": parameters, "refused": None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x4", help="jstrategy's topology_devices name")
    parser.add_argument("--compile-topology", default="v5p-32", help="MaxText's name for it")
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 8], help="expert degrees")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--sides", nargs="+", choices=("jstrategy", "maxtext"),
                        default=["jstrategy", "maxtext"])  # fmt: skip
    args = parser.parse_args(argv)
    shape = mixtral_8x7b(args.layers, args.seq)
    chips = len(topology_devices(args.topology))
    print(f"jax {jax.__version__}; {args.topology} ({chips} chips); {shape}; "
          f"{shape.parameters():,} parameters by the formula", flush=True)  # fmt: skip
    rows = []
    for experts in args.experts:
        found = {}
        for side in args.sides:
            start = time.time()
            if side == "jstrategy":
                found[side] = jstrategy_row(shape, args.topology, experts)
            else:
                found[side] = maxtext_row(shape, args.compile_topology, chips, experts)
            found[side]["seconds"] = round(time.time() - start)
            print(side, f"experts={experts}:", found[side], flush=True)
            if found[side]["parameters"] not in (None, shape.parameters()):
                raise AssertionError(f"{side}: {found[side]['parameters']:,} parameters, not "
                                     f"{shape.parameters():,}")  # fmt: skip
            gc.collect()
        rows.append((experts, found))
    print(
        "\n| layout (16 chips) | jstrategy peak GiB | MaxText peak GiB | peak ratio |\n|---|---|---|---|"
    )
    for experts, found in rows:
        layout = f"FSDP {chips}" if experts == 1 else f"expert {experts} x fsdp {chips // experts}"
        peaks = [found.get(s, {}).get("peak") for s in ("jstrategy", "maxtext")]
        cells = [f"{p / 2**30:.2f}" if p else "-" for p in peaks]
        ratio = f"{peaks[0] / peaks[1]:.2f}x" if all(peaks) else "-"
        print(f"| {layout} | {cells[0]} | {cells[1]} | {ratio} |")


if __name__ == "__main__":
    main()
