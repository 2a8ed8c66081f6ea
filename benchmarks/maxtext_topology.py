"""The MaxText comparison at real size, compiled by the TPU compiler for a slice not at hand.

``maxtext_compare.py --topology v5p:2x2x4`` (this module's `main`) compiles each row's train
step for every chip of a TPU topology with libtpu on a machine without a TPU, nothing
allocated, and reads the compiled program's per-chip peak (``memory_analysis()``: arguments
+ temporaries + outputs - aliased), the figure the TPU runtime would allocate:

* **MaxText 0.2.5** as its ``train_compile.py`` compiles (``compile_topology=v5p-32``): its
  topology mesh, shaped state and batch, and ``train_step`` jitted with its shardings,
  donation and logical axis rules (`train_compile` functions, called in that order), with
  the CPU comparison's overrides (`maxtext_compare.maxtext_settings`: float32, remat
  ``full``, scanned layers, AdamW, dot-product attention) and the row's ``ici_*`` degrees.
* **jstrategy** through `jstrategy.experimental.plan` of `maxtext_compare.Decoder`, the
  model as written, over a strategy built on
  `jstrategy.experimental.topology_devices` (``remat=True``, the same AdamW).

libtpu serves one process at a time on a machine, so each side of each row compiles in its
own subprocess, one after the other; ``--lock FILE`` runs each under ``flock FILE`` so that
other libtpu users of the machine queue with it. The mixed-precision rows are MaxText
``dtype=bfloat16 weight_dtype=float32`` and jstrategy ``dtype_policy="mixed_bfloat16"``.
The decoder has no grouped-query attention, so the 70B-shaped rows have 64 kv heads on both
sides (70B's parameters but for the k/v projections: 8 kv heads would save 1.9B).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import maxtext_compare as mc

LLAMA2_7B = mc.Shape(layers=32, d_model=4096, heads=32, mlp=11008, vocab=32000, seq=2048)
SHAPE_70B = mc.Shape(layers=80, d_model=8192, heads=64, mlp=28672, vocab=32000, seq=2048)
LONG_7B = dataclasses.replace(LLAMA2_7B, seq=32768)
HBM = {"v5p": 95 * 2**30, "v5e": 16 * 2**30, "v4": 32 * 2**30}
PRECISIONS = ("float32", "mixed_bfloat16")
RESULT = "TOPOLOGY-RESULT "


@dataclasses.dataclass(frozen=True)
class TopologyRow:
    """One comparison: a model, a slice (JAX's and MaxText's names), a layout on each side."""

    key: str
    label: str
    shape: mc.Shape
    topology: str  # jax: "v5p:2x2x4"
    maxtext_topology: str  # MaxText's compile_topology: "v5p-32"
    chips: int
    batch: int  # global, sequences
    maxtext: dict[str, Any]  # MaxText's ici_* degrees (and pipeline settings)
    jstrategy: str  # fsdp | tensor | hybrid | gpipe | circular | context
    degrees: tuple[int, ...] = ()
    tensor_activations: str = "features"  # jstrategy's split between blocks (tensor rows)


_PIPE = {"ici_pipeline_parallelism": 4, "ici_data_parallelism": 4, "ici_fsdp_parallelism": 1}
ROWS = {
    row.key: row
    for row in (
        TopologyRow("7b-fsdp", "llama2-7B, FSDP 16", LLAMA2_7B, "v5p:2x2x4", "v5p-32", 16, 16,
                    {"ici_fsdp_parallelism": 16}, "fsdp"),
        TopologyRow("7b-data-tensor", "llama2-7B, data 2 x tensor 8", LLAMA2_7B, "v5p:2x2x4",
                    "v5p-32", 16, 16,
                    {"ici_data_parallelism": 2, "ici_tensor_parallelism": 8,
                     "ici_fsdp_parallelism": 1}, "tensor", (2, 8)),
        TopologyRow("7b-fsdp-tensor", "llama2-7B, FSDP 4 x tensor 4", LLAMA2_7B, "v5p:2x2x4",
                    "v5p-32", 16, 16,
                    {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 4}, "hybrid", (4, 4)),
        # The same two rows with Megatron's sequence parallelism (jstrategy's
        # ``tensor_activations="sequence"``); MaxText as above.
        TopologyRow("7b-data-tensor-seq", "llama2-7B, data 2 x tensor 8, sequence-split",
                    LLAMA2_7B, "v5p:2x2x4", "v5p-32", 16, 16,
                    {"ici_data_parallelism": 2, "ici_tensor_parallelism": 8,
                     "ici_fsdp_parallelism": 1}, "tensor", (2, 8), "sequence"),
        TopologyRow("7b-fsdp-tensor-seq", "llama2-7B, FSDP 4 x tensor 4, sequence-split",
                    LLAMA2_7B, "v5p:2x2x4", "v5p-32", 16, 16,
                    {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 4}, "hybrid", (4, 4),
                    "sequence"),
        TopologyRow("7b-gpipe", "llama2-7B, pipeline 4 (GPipe, M 8) x data 4", LLAMA2_7B,
                    "v5p:2x2x4", "v5p-32", 16, 32,
                    {**_PIPE, "num_pipeline_microbatches": 8,
                     "num_layers_per_pipeline_stage": 8, "num_pipeline_repeats": 1}, "gpipe"),
        TopologyRow("7b-circular", "llama2-7B, pipeline 4 (circular x 4, M 8) x data 4",
                    LLAMA2_7B, "v5p:2x2x4", "v5p-32", 16, 32,
                    {**_PIPE, "num_pipeline_microbatches": 8,
                     "num_layers_per_pipeline_stage": 2}, "circular", (4,)),
        # MaxText's context parallelism with its flash (splash) attention, as it is run;
        # jstrategy's with its ring attention: neither forms a sequence's whole scores.
        TopologyRow("7b-32k-context", "llama2-7B at 32k tokens, FSDP 4 x context 4",
                    LONG_7B, "v5p:2x2x4", "v5p-32", 16, 4,
                    {"ici_fsdp_parallelism": 4, "ici_context_parallelism": 4,
                     "attention": "flash"}, "context", (4,)),
        TopologyRow("70b-fsdp", "70B-shaped, FSDP 64", SHAPE_70B, "v5p:4x4x4", "v5p-128", 64, 64,
                    {"ici_fsdp_parallelism": 64}, "fsdp"),
        TopologyRow("70b-fsdp-tensor", "70B-shaped, FSDP 16 x tensor 4", SHAPE_70B, "v5p:4x4x4",
                    "v5p-128", 64, 64,
                    {"ici_fsdp_parallelism": 16, "ici_tensor_parallelism": 4}, "hybrid", (16, 4)),
        TopologyRow("70b-fsdp-tensor-seq", "70B-shaped, FSDP 16 x tensor 4, sequence-split",
                    SHAPE_70B, "v5p:4x4x4", "v5p-128", 64, 64,
                    {"ici_fsdp_parallelism": 16, "ici_tensor_parallelism": 4}, "hybrid", (16, 4),
                    "sequence"),
    )
}  # fmt: skip


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f}"


# Each side, in its own process ----------------------------------------------------------
def maxtext_train_compile(
    settings: dict[str, Any], program: str = "maxtext_topology"
) -> tuple[int, Callable[[], Any]]:
    """MaxText's train step for `settings` (overrides of its ``decoupled_base_test.yml``,
    ``compile_topology`` among them) as its ``train_compile.py`` builds it: the topology's
    mesh, the shaped state and batch, their shardings and the functional train step.

    Returns the state's parameter count (-1 where MaxText's state is not laid out as read
    here: the count is a check only) and a function that compiles the step under the
    mesh and logical axis rules (raising what the TPU compiler raises, its refusal for
    memory too). The dense rows' and `maxtext_moe_topology`'s MaxText side.
    """
    import jax
    import maxtext
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils
    from maxtext.utils import sharding

    config_file = Path(maxtext.__file__).parent / "configs" / "decoupled_base_test.yml"
    overrides = [f"{key}={value}" for key, value in settings.items()]
    config = pyconfig.initialize([program, str(config_file), *overrides])
    jax.config.update("jax_use_shardy_partitioner", config.shardy)  # as train.initialize
    mesh = train_compile.get_topology_mesh(config)
    print("MaxText mesh:", {k: v for k, v in mesh.shape.items() if v > 1}, flush=True)
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings
    )
    try:
        params = nnx.State(args[0]["model"]).filter(nnx.Param)
        parameters = sum(leaf.size for leaf in jax.tree.leaves(params))
    except Exception:  # the count is a check only; MaxText's state layout may change
        parameters = -1

    def compile_step() -> Any:
        return train_compile.jit_and_compile(
            func, args, kwargs, mesh, in_shard, out_shard, static, donate, config,
            logical_axis_rules(config.logical_axis_rules),
        )  # fmt: skip

    return parameters, compile_step


def maxtext_compiled(row: TopologyRow, precision: str) -> dict[str, Any]:
    """MaxText's train step compiled for the row's topology as ``train_compile.py`` does."""
    settings = mc.maxtext_settings(row.shape, "scanned", row.batch / row.chips)
    settings.update(hardware="tpu", compile_topology=row.maxtext_topology,
                    compile_topology_num_slices=1, run_name="maxtext_topology", **row.maxtext)  # fmt: skip
    if precision == "mixed_bfloat16":
        settings["dtype"] = "bfloat16"
    parameters, compile_step = maxtext_train_compile(settings)
    memory = mc.analysed(compile_step())
    peak = memory["arguments"] + memory["temporaries"] + memory["outputs"] - memory["aliased"]
    parts = ", ".join(f"{key} {_gib(value)}" for key, value in memory.items())
    return {"peak": peak, "parameters": parameters, "parts": parts}


def jstrategy_strategy(row: TopologyRow) -> Any:
    """The row's strategy over the topology's compile-only devices."""
    from jstrategy import experimental as jx

    devices = jx.topology_devices(row.topology)
    if row.jstrategy == "fsdp":
        return jx.FSDPStrategy(devices=devices)
    if row.jstrategy == "context":
        return jx.FSDPStrategy(devices=devices, context=row.degrees[0])
    if row.jstrategy == "tensor":
        return mc.megatron_strategy(True, shape=row.degrees, devices=devices,
                                    tensor_activations=row.tensor_activations)  # fmt: skip
    if row.jstrategy == "hybrid":
        fsdp, tensor = row.degrees
        mesh = jx.DeviceMesh((fsdp, tensor), ("fsdp", "model"), devices=devices)
        # A topology's devices carry their hosts' process indices (4 chips a v5p host): the
        # FSDP degree spans the hosts, the tensor degree stays within one, as MaxText's
        # device mesh lays ici_fsdp x ici_tensor on a slice.
        hosts = len({device.process_index for device in devices})
        return jx.HybridStrategy(replicas=1, fsdp=fsdp, tensor=tensor, dcn_replicas=1,
                                 dcn_fsdp=hosts, devices=devices,
                                 layout_map=mc.megatron_layout(mesh, True),
                                 tensor_activations=row.tensor_activations)  # fmt: skip
    repeats = row.degrees[0] if row.degrees else 1
    return jx.PipelineStrategy(devices, num_stages=4, num_microbatches=8, num_repeats=repeats)


def jstrategy_planned(row: TopologyRow, precision: str) -> dict[str, Any]:
    """jstrategy's train step planned (compiled) for the row's topology by `plan`."""
    import jax
    import jax.numpy as jnp
    import optax

    from jstrategy.experimental import plan

    strategy = jstrategy_strategy(row)
    pipelined = row.jstrategy in ("gpipe", "circular")
    model = mc.Decoder(row.shape, layers="repeated" if pipelined else "scanned",
                       context=row.jstrategy == "context")  # fmt: skip
    tokens = jax.ShapeDtypeStruct((row.batch, row.shape.seq), jnp.int32)
    report = plan(
        model, strategy, (tokens, tokens), optimizer=optax.adamw(mc.LEARNING_RATE, **mc.ADAMW),
        loss=mc.token_loss, remat=True, device_memory=HBM[row.topology.split(":")[0]],
        dtype_policy=precision if precision != "float32" else None, find_largest_batch=False,
    )  # fmt: skip
    print(report, flush=True)
    one = jax.ShapeDtypeStruct((1, row.shape.seq), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), one)
    parameters = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    parts = (f"parameters {_gib(report.parameters)}, optimizer {_gib(report.optimizer_state)}, "
             f"gradients {_gib(report.gradients)}, activations and temporaries "
             f"{_gib(report.activations)}")  # fmt: skip
    refused = report.compiler_refusal is not None
    return {"peak": report.peak, "parameters": parameters, "parts": parts, "refused": refused}


def run_side(side: str, key: str, precision: str) -> None:
    """The child process: compile one side of one row, print its figures as one line."""
    start = time.perf_counter()
    try:
        compile_side = maxtext_compiled if side == "maxtext" else jstrategy_planned
        result = compile_side(ROWS[key], precision)
    except Exception as error:  # a side's own failure is the row's note, not the run's end
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    result["seconds"] = time.perf_counter() - start
    print(RESULT + json.dumps(result), flush=True)


# The parent: the table ------------------------------------------------------------------
def in_subprocess(side: str, key: str, precision: str, args: argparse.Namespace) -> dict:
    """One side compiled in a child process (libtpu's one-process lock), its log kept."""
    command = [sys.executable, __file__, "--side", side, "--row", key, "--precision", precision]
    return run_logged(command, args.lock, Path(args.log_dir) / f"{key}-{precision}-{side}.log")


def run_logged(command: list[str], lock: str | None, log: Path, marker: str = RESULT) -> dict:
    """`command` in a child process (under ``flock lock`` where given) that loads the TPU
    plugin, its output kept in `log`; its last line starting with `marker`, parsed."""
    if lock:
        command = ["flock", lock, *command]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               DECOUPLE_GCLOUD="TRUE")  # fmt: skip
    env.pop("JAX_PLATFORMS", None)  # the TPU plugin must load, for its topologies
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    lines = [line for line in log.read_text().splitlines() if line.startswith(marker)]
    if not lines:
        return {"error": f"no result; see {log}", "seconds": float("nan")}
    return json.loads(lines[-1][len(marker) :])


HEADER = (
    "| row | precision | jstrategy GiB/chip | MaxText GiB/chip | ratio | jstrategy compile s | "
    "MaxText compile s | note |\n|---|---|---|---|---|---|---|---|"
)


def format_row(row: TopologyRow, precision: str, j: dict, m: dict) -> str:
    peak = lambda side: "-" if "peak" not in side else _gib(side["peak"])  # noqa: E731
    ratio = f"{j['peak'] / m['peak']:.2f}x" if "peak" in j and "peak" in m else "-"
    notes = [f"{name}: {side['error']}" for name, side in (("jstrategy", j), ("MaxText", m))
             if "error" in side]  # fmt: skip
    if j.get("refused"):
        notes.append("jstrategy: the TPU compiler refused it for memory (its figure)")
    cells = [f"{row.label} ({row.maxtext_topology})", precision, peak(j), peak(m), ratio,
             f"{j['seconds']:.0f}", f"{m['seconds']:.0f}", "; ".join(notes)]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", help="e.g. v5p:2x2x4 (7B rows), v5p:4x4x4 (70B rows)")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), help="default: the topology's")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["float32"])
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=("maxtext", "jstrategy"),
        default=["maxtext", "jstrategy"],
        help="compile these sides only",
    )
    parser.add_argument("--lock", help="run each compiling process under `flock LOCK`")
    parser.add_argument("--log-dir", default="/tmp/maxtext_topology", help="each side's log")
    parser.add_argument("--largest-batch", action="store_true",
                        help="jstrategy only: the largest batch a chip of --topology fits, "
                        "for the 7B rows (`topology_largest_batch`)")  # fmt: skip
    parser.add_argument("--verify", action="store_true",
                        help="with --largest-batch: recompile at the batch found, compare")  # fmt: skip
    parser.add_argument("--side", choices=("maxtext", "jstrategy"), help=argparse.SUPPRESS)
    parser.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        run_side(args.side, args.row, args.precision[0])
        return []
    if args.largest_batch:
        import topology_largest_batch

        return topology_largest_batch.main(args)
    keys = args.rows or [key for key, row in ROWS.items() if row.topology == args.topology]
    if not keys:
        raise SystemExit(f"No rows on --topology {args.topology!r}; rows: "
                         + ", ".join(f"{k} ({r.topology})" for k, r in ROWS.items()))  # fmt: skip
    table = []
    for key in keys:
        row = ROWS[key]
        for precision in args.precision:
            print(f"{row.label}, {precision}: {row.shape}, global batch {row.batch}", flush=True)
            skipped = {"error": "not compiled (--sides)", "seconds": float("nan")}
            m, j = (in_subprocess(side, key, precision, args) if side in args.sides else skipped
                    for side in ("maxtext", "jstrategy"))  # fmt: skip
            for name, side in (("jstrategy", j), ("MaxText", m)):
                count = side.get("parameters", -1)
                print(f"  {name}: {side.get('parts', side.get('error'))}; {count:,} parameters "
                      f"(formula {row.shape.parameters():,})", flush=True)  # fmt: skip
            table.append(format_row(row, precision, j, m))
            print(table[-1], flush=True)
    print()
    print(HEADER)
    print("\n".join(table))
    return table


if __name__ == "__main__":
    main(sys.argv[1:])
