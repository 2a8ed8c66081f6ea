"""How large a transformer each strategy's train step fits per device, from compiled memory.

Everything here is read from XLA's memory analysis of compiled programs, lowered from
abstract inputs (`jax.ShapeDtypeStruct` with the strategy's shardings), so nothing is
allocated and models far larger than this machine's memory can be measured. The step's
peak per device is arguments + temporaries + outputs - aliased (donated) bytes, as
`tests/test_sharded_memory.py` measures it.

Part 1, per device count (4, 8 and 16 fake devices, each in its own process: the device
count is fixed when JAX starts, so the script re-runs itself with another ``XLA_FLAGS``):
the transformer LM of `examples/transformer_lm.py`, unrolled and scanned
(``scan_layers``), with and without rematerialization (``remat=True``), AdamW, one
fixed global batch. For Mirrored, FSDP and ModelParallel (the example's Megatron layout,
a ``"model"`` axis of 4): the train state per device (parameters and AdamW's moments),
the jstrategy step's peak per device, and the peak of the same step hand-written as a
global-view ``jax.jit`` over the same `NamedSharding`s. "creation peak" is the peak of
creating the train state: the compiled program of
`jstrategy.training.compile_train_state_creation`.

Part 2, at 8 devices: the largest transformer (family ``d_model = 256 k``, ``n_layers =
4 k``, ``n_heads = 4 k``; scanned and rematerialized) whose step fits a per-device budget
of 16 GiB and of 80 GiB, per strategy and precision policy (``float32`` and
``mixed_bfloat16``), found by binary search on ``k``.

These are the CPU compiler's figures: on GPU and TPU, XLA's scheduling and fusion differ,
so the bytes do too, but the ratios between strategies and settings carry over.

    python benchmarks/largest_model.py --progress     # ~40 minutes on 2 shared cores
    python benchmarks/largest_model.py --no-search    # part 1 only
    python benchmarks/largest_model.py --tiny         # the test's configuration
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm
from _common import compiled_peak

import jstrategy
from jstrategy import mixed_precision
from jstrategy import training
from jstrategy._src.placement import variable_shardings
from jstrategy._src.training.step import remat as remat_lib
from jstrategy.experimental import plan

GIB = 1 << 30
STRATEGY_NAMES = ("Mirrored", "FSDP", "ModelParallel")


def make_strategy(name: str, *, scan_layers: bool) -> jstrategy.Strategy:
    if name == "Mirrored":
        return jstrategy.MirroredStrategy()
    if name == "FSDP":
        return jstrategy.experimental.FSDPStrategy()
    return transformer_lm.megatron_strategy(scan_layers=scan_layers)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int  # global, in sequences

    def model(self, *, scan_layers: bool) -> transformer_lm.TransformerLM:
        return transformer_lm.TransformerLM(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            attention="xla",
            scan_layers=scan_layers,
        )


_peak = compiled_peak


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _per_device(tree: Any) -> int:
    """Bytes on the fullest device of abstract arrays with shardings (the same on each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        size = 1
        for d in shape:
            size *= d
        total += size * jnp.dtype(leaf.dtype).itemsize
    return total


def creation_peak(strategy: jstrategy.Strategy, model: Any, tx: Any, sample: Any) -> int | None:
    """CREATION PEAK: the compiled state-creation program's peak per device.

    `jstrategy.training.compile_train_state_creation` gives the program
    `create_train_state` runs where variables are split (``module.init`` and ``tx.init``
    jitted with ``out_shardings`` from `variable_sharding`); for Mirrored, the same program
    shows what one device would hold (Mirrored creates eagerly, then copies).
    """
    return _peak(training.compile_train_state_creation(model, tx, sample, strategy=strategy))


@dataclasses.dataclass
class Measured:
    state: int  # parameters + AdamW moments on the fullest device
    peak: int  # the jstrategy step's peak per device
    hand_written: int | None  # the global-view jax.jit step's peak per device
    creation: int | None
    params: int  # the model's parameter count


def measure(
    strategy_name: str,
    config: Config,
    *,
    scan_layers: bool,
    remat: bool | str,
    policy: str = "float32",
    hand_written: bool = True,
) -> Measured:
    """Lowers and compiles the step from abstract inputs; reads its memory analysis.

    `remat`: the train step's ``remat`` (False: none; True: nothing saved in a block; or
    a ``jax.checkpoint_policies`` policy's name); the hand-written step uses the same.
    """
    strategy = make_strategy(strategy_name, scan_layers=scan_layers)
    model = config.model(scan_layers=scan_layers)
    tx = optax.adamw(1e-3, b2=0.98, weight_decay=0.01)
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    b, t = config.batch_size, config.seq_len
    # The jstrategy step's peak: `plan` compiles it from shapes alone.
    planned = plan(
        model,
        strategy,
        (jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.int32)),
        optimizer=tx,
        loss=transformer_lm.lm_loss,
        dtype_policy=policy,
        remat=remat or None,
        device_memory=1 << 60,  # only the peak is read
        find_largest_batch=False,
    )
    peak = planned.peak
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    opt_state = jax.eval_shape(tx.init, params)
    shardings = variable_shardings((params, opt_state), strategy)
    params, opt_state = _abstract((params, opt_state), shardings)
    rows = strategy.batch_sharding()
    batch = (
        jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows),
        jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows),
    )
    reference = None
    if hand_written:
        reference = _hand_written_peak(model, tx, policy, remat, shardings, rows, params, batch)
    n_params = sum(_size(leaf.shape) for leaf in jax.tree.leaves(params))
    return Measured(
        _per_device((params, opt_state)),
        peak,
        reference,
        creation_peak(strategy, model, tx, tokens),
        n_params,
    )


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hand_written_peak(
    model: Any,
    tx: Any,
    policy: str,
    remat: bool | str,
    shardings: Any,
    rows: NamedSharding,
    params: Any,
    batch: Any,
    loss_fn: Any = transformer_lm.lm_loss,
) -> int:
    """The same step written by hand in the global view: one ``jax.jit`` whose inputs and
    outputs carry the strategy's `NamedSharding`s, gradients constrained to the
    parameters' (so XLA reduce-scatters them where they are split)."""
    param_shardings, opt_shardings = shardings
    compute = mixed_precision.Policy(policy)
    checkpoint = remat_lib.resolve_remat(remat)

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def mean_loss(p: Any) -> jax.Array:
            if policy != "float32":
                p = mixed_precision.cast_to_compute(p, compute)
            with remat_lib.applying(checkpoint):
                logits = model.apply({"params": p}, x)
            return loss_fn(y, logits).mean()

        loss, grads = jax.value_and_grad(mean_loss)(params)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch_rows = NamedSharding(rows.mesh, P(*rows.spec))
    program = jax.jit(
        step,
        in_shardings=(param_shardings, opt_shardings, batch_rows, batch_rows),
        out_shardings=(param_shardings, opt_shardings, None),
        donate_argnums=(0, 1),
    )
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_state, opt_shardings
    )
    return _peak(program.lower(params, opt_state, *batch).compile())


def family(k: int, base: Config) -> Config:
    """The ``k``-th transformer of the search: width 256 k, depth 4 k, 4 k heads of 64."""
    return dataclasses.replace(base, d_model=256 * k, n_layers=4 * k, n_heads=4 * k)


def largest(
    strategy_name: str, policy: str, budgets: tuple[float, ...], base: Config, k_max: int
) -> dict[float, tuple[int, Measured] | None]:
    """The largest ``k`` whose step's peak fits each budget (GiB), by binary search."""
    memo: dict[int, Measured] = {}

    def at(k: int) -> Measured:
        if k not in memo:
            memo[k] = measure(
                strategy_name,
                family(k, base),
                scan_layers=True,
                remat=True,
                policy=policy,
                hand_written=False,
            )
        return memo[k]

    out: dict[float, tuple[int, Measured] | None] = {}
    for budget in budgets:
        lo, hi = 0, k_max + 1  # fits at lo (0: nothing), not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid).peak <= budget * GIB:
                lo = mid
            else:
                hi = mid
        out[budget] = (lo, at(lo)) if lo else None
    return out


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):.1f}"


def worker(args: argparse.Namespace) -> None:
    """Part 1 (and part 2 with --search) in this process's device count: JSON lines."""
    config = Config(
        args.vocab_size, args.d_model, args.n_layers, args.n_heads, args.seq_len, args.batch_size
    )
    for scan_layers in [m == "scanned" for m in args.models if not args.only_search]:
        for remat in [r == "on" for r in args.remat]:
            for name in STRATEGY_NAMES:
                m = measure(name, config, scan_layers=scan_layers, remat=remat)
                row = dataclasses.asdict(m) | {
                    "devices": jax.device_count(),
                    "model": "scanned" if scan_layers else "unrolled",
                    "remat": remat,
                    "strategy": name,
                }
                print(json.dumps(row), flush=True)
    if args.search:
        base = dataclasses.replace(
            config, seq_len=args.search_seq_len, batch_size=args.search_batch_size
        )
        base = dataclasses.replace(base, vocab_size=args.search_vocab_size)
        for name in STRATEGY_NAMES:
            for policy in args.policies:
                found = largest(name, policy, tuple(args.budgets), base, args.k_max)
                for budget, hit in found.items():
                    row = {"search": True, "strategy": name, "policy": policy, "budget": budget}
                    if hit is not None:
                        k, m = hit
                        row |= {"k": k, "params": m.params, "peak": m.peak, "state": m.state}
                    print(json.dumps(row), flush=True)


def _run(devices: int, argv: list[str], search: bool, progress: bool) -> list[dict[str, Any]]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    command = [sys.executable, __file__, "--worker", *argv] + (["--search"] if search else [])
    rows = []
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:  # as they come: --progress shows them on stderr
            if line.startswith("{"):
                rows.append(json.loads(line))
                if progress:
                    sys.stderr.write(line)
        errors = process.stderr.read()
    if process.returncode:
        sys.stderr.write(errors)
        raise SystemExit(f"The {devices}-device run failed (exit {process.returncode}).")
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"jax {jax.__version__}, fake CPU devices; TransformerLM d_model={args.d_model} "
        f"layers={args.n_layers} heads={args.n_heads} seq={args.seq_len} "
        f"vocab={args.vocab_size}, AdamW, float32, global batch {args.batch_size}"
    )
    print("MiB per device: train state; the step's peak (jstrategy, and the hand-written")
    print("global-view jax.jit of the same step); creation peak (state creation).")
    print()
    print("| devices | model | remat | strategy | state | step peak | hand-written | "
          "peak / hand-written | creation peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    table = [r for r in rows if not r.get("search")]
    for r in table:
        ratio = r["peak"] / r["hand_written"]
        print(
            f"| {r['devices']} | {r['model']} | {'on' if r['remat'] else 'off'} | "
            f"{r['strategy']} | {_mib(r['state'])} | {_mib(r['peak'])} | "
            f"{_mib(r['hand_written'])} | {ratio:.2f} | {_mib(r['creation'])} |"
        )
    print()
    print("The step's peak per device as devices are added (MiB):")
    keys = sorted({(r["model"], r["remat"], r["strategy"]) for r in table})
    for model, remat, name in keys:
        key = (model, remat, name)
        peaks = [r["peak"] for r in table if (r["model"], r["remat"], r["strategy"]) == key]
        falls = all(b < a for a, b in itertools.pairwise(peaks))
        trend = " -> ".join(_mib(p) for p in peaks)
        print(
            f"  {name:<14} {model:<9} remat {'on ' if remat else 'off'}: {trend}"
            f"  {'falls' if falls else 'DOES NOT FALL'}"
        )
    search = [r for r in rows if r.get("search")]
    if search:
        print()
        print(
            f"The largest transformer whose step fits (8 devices; d_model = 256 k, n_layers "
            f"= 4 k, heads of 64; scanned, remat on; AdamW; seq {args.search_seq_len}, "
            f"global batch {args.search_batch_size}, vocab {args.search_vocab_size}; "
            f"k <= {args.k_max}):"
        )
        print()
        print("| strategy | policy | budget per device | k | parameters | step peak GiB | "
              "state GiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for r in search:
            if "k" not in r:
                print(f"| {r['strategy']} | {r['policy']} | {r['budget']:g} GiB | - | "
                      "none fits | | |")  # fmt: skip
                continue
            limit = " (k_max)" if r["k"] == args.k_max else ""
            print(
                f"| {r['strategy']} | {r['policy']} | {r['budget']:g} GiB | {r['k']}{limit} | "
                f"{r['params'] / 1e6:,.0f}M | {r['peak'] / GIB:.2f} | {r['state'] / GIB:.2f} |"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--search", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a configuration of seconds")
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--budgets", type=float, nargs="+", default=[16.0, 80.0])
    parser.add_argument("--search-seq-len", type=int, default=1024)
    parser.add_argument("--search-batch-size", type=int, default=16)
    parser.add_argument("--search-vocab-size", type=int, default=32768)
    parser.add_argument("--k-max", type=int, default=32, help="the search's largest k")
    parser.add_argument("--no-search", action="store_true", help="skip part 2")
    parser.add_argument("--progress", action="store_true", help="each figure on stderr")
    parser.add_argument("--only-search", action="store_true", help="part 2 only (8 devices)")
    parser.add_argument(
        "--models", nargs="+", choices=["unrolled", "scanned"], default=["unrolled", "scanned"]
    )
    parser.add_argument("--remat", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=["float32", "mixed_bfloat16"],
        default=["float32", "mixed_bfloat16"],
        help="the search's precision policies",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.n_layers, args.n_heads, args.seq_len = 32, 2, 4, 16
        args.vocab_size, args.batch_size, args.devices = 64, 16, [4, 8]
        args.search_seq_len, args.search_batch_size, args.search_vocab_size = 32, 8, 64
        args.k_max, args.budgets, args.policies = 1, [1.0], ["float32"]
        args.models, args.remat = ["scanned"], ["on"]
    if args.worker:
        worker(args)
        return
    forwarded = [
        f"--d-model={args.d_model}",
        f"--n-layers={args.n_layers}",
        f"--n-heads={args.n_heads}",
        f"--seq-len={args.seq_len}",
        f"--vocab-size={args.vocab_size}",
        f"--batch-size={args.batch_size}",
        f"--search-seq-len={args.search_seq_len}",
        f"--search-batch-size={args.search_batch_size}",
        f"--search-vocab-size={args.search_vocab_size}",
        f"--k-max={args.k_max}",
        "--models",
        *args.models,
        "--remat",
        *args.remat,
        "--policies",
        *args.policies,
        *(["--only-search"] if args.only_search else []),
        "--budgets",
        *map(str, args.budgets),
    ]
    rows: list[dict[str, Any]] = []
    for devices in [8] if args.only_search else args.devices:
        search = devices == 8 and not args.no_search
        rows += _run(devices, forwarded, search=search, progress=args.progress)
    report(rows, args)


if __name__ == "__main__":
    main()
