"""Issue 19's table: the compiled train step's peak per device, over one parameter copy.

The three models of issue 19 (8 fake CPU devices, AdamW, float32): 16 residual MLP
blocks (d 512, 4x hidden) unrolled and under ``nn.scan``, and `examples/transformer_lm.py`
with 16 layers of d 512 (the example's other defaults: vocab 128, 4 heads, 64 tokens; a
global batch of 8 sequences, as issue 19 measured), unrolled, and with ``--scan-layers``
under the example's three remat settings: its default (``--remat auto``, which for scanned
blocks is ``dots_with_no_batch_dims_saveable``), ``none`` and ``full``. For each, the peak per device
(the compiled program's ``memory_analysis()``: arguments + temporaries + outputs - aliased)
of the jstrategy train step under `MirroredStrategy` and `FSDPStrategy` (8), and of the
same FSDP step hand-written as a global-view ``jax.jit`` over the same `NamedSharding`s,
each divided by the bytes of one parameter copy. Everything is lowered from abstract
inputs (nothing allocated), as in `largest_model.py`, whose measuring this reuses.

Before the global-view step (issue 19's measurements on the earlier main): FSDP 1.43x
(MLP unrolled), 2.91x (MLP scanned), 1.65x (transformer unrolled); hand-written 0.43x,
0.57x and 1.07x.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fsdp_peak.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import largest_model
import transformer_lm

import jstrategy
from jstrategy import training
from jstrategy._src.placement import variable_shardings


class _Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x: Any, _: Any = None) -> Any:
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h)), None


class ResidualMLP(nn.Module):
    """Issue 19's MLP: `blocks` residual blocks of `width`, unrolled or under ``nn.scan``."""

    width: int = 512
    blocks: int = 16
    scanned: bool = False

    @nn.compact
    def __call__(self, x: Any) -> Any:
        if self.scanned:
            stack = nn.scan(
                _Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.blocks
            )
            x, _ = stack(self.width, name="blocks")(x, None)
        else:
            for i in range(self.blocks):
                x, _ = _Block(self.width, name=f"block_{i}")(x)
        return nn.Dense(8)(x)


def _loss(y: Any, logits: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def mlp_peaks(module: ResidualMLP, rows: int) -> dict[str, float]:
    """Mirrored, FSDP and hand-written peaks per device over one parameter copy."""
    tx = optax.adamw(1e-3)
    sample = jnp.ones((1, module.width))
    params = jax.eval_shape(module.init, jax.random.key(0), sample)["params"]
    one_copy = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    out: dict[str, float] = {}
    for name, strategy in (
        ("Mirrored", jstrategy.MirroredStrategy()),
        ("FSDP", jstrategy.experimental.FSDPStrategy()),
    ):
        with strategy.scope():
            small = training.create_train_state(
                ResidualMLP(8, 2, module.scanned), tx, jnp.ones((1, 8)), rng=0
            )
            step = training.make_train_step(_loss)
        abstract_params = jax.eval_shape(module.init, jax.random.key(0), sample)["params"]
        opt_state = jax.eval_shape(tx.init, abstract_params)
        shardings = variable_shardings((abstract_params, opt_state), strategy)
        p, o = largest_model._abstract((abstract_params, opt_state), shardings)
        rest = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            small.replace(params=None, opt_state=None),
        )
        state = rest.replace(params=p, opt_state=o, apply_fn=module.apply)
        sharding = strategy.batch_sharding()
        x = jax.ShapeDtypeStruct((rows, module.width), jnp.float32, sharding=sharding)
        y = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)
        mask = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=sharding)
        compiled = step._program.lower(state, None, (x, y), mask).compile()
        out[name] = largest_model._peak(compiled) / one_copy
        if name == "FSDP":
            hand_written = largest_model._hand_written_peak(
                module, tx, "float32", False, shardings, sharding, p, (x, y), loss_fn=_loss
            )
            out["hand-written"] = hand_written / one_copy
    return out


def transformer_peaks(
    config: largest_model.Config, *, scan_layers: bool, remat: bool | str = False
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("Mirrored", "FSDP"):
        m = largest_model.measure(
            name, config, scan_layers=scan_layers, remat=remat, hand_written=name == "FSDP"
        )
        one_copy = m.params * 4  # float32
        out[name] = m.peak / one_copy
        if m.hand_written is not None:
            out["hand-written"] = m.hand_written / one_copy
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64, help="the MLP's global batch")
    # The transformer: examples/transformer_lm.py's defaults but for the width and depth.
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    # 8 sequences: issue 19's configuration (its hand-written unrolled step: 1.07x).
    parser.add_argument("--batch-size", type=int, default=8, help="global, in sequences")
    args = parser.parse_args()
    config = largest_model.Config(
        vocab_size=args.vocab_size,
        d_model=args.width,
        n_layers=args.blocks,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    auto = transformer_lm.default_remat(scan_layers=True)
    rows = [
        (f"{args.blocks} residual MLP blocks (d {args.width}), unrolled",
         mlp_peaks(ResidualMLP(args.width, args.blocks, False), args.rows)),
        (f"the same {args.blocks} blocks under nn.scan",
         mlp_peaks(ResidualMLP(args.width, args.blocks, True), args.rows)),
        (f"transformer_lm, {args.blocks} layers, d {args.width}",
         transformer_peaks(config, scan_layers=False)),
        (f"transformer_lm, {args.blocks} layers, d {args.width}, --scan-layers "
         f"(--remat auto: {auto})",
         transformer_peaks(config, scan_layers=True, remat=auto)),
        (f"transformer_lm, {args.blocks} layers, d {args.width}, --scan-layers --remat none",
         transformer_peaks(config, scan_layers=True)),
        (f"transformer_lm, {args.blocks} layers, d {args.width}, --scan-layers --remat full",
         transformer_peaks(config, scan_layers=True, remat=True)),
    ]  # fmt: skip
    print(f"{len(jax.devices())} devices, AdamW, float32: step peak per device / one param copy")
    print(
        "| model | Mirrored | jstrategy FSDP | hand-written global-view jit | FSDP / hand-written |"
    )
    print("|---|---|---|---|---|")
    for name, r in rows:
        ratio = r["FSDP"] / r["hand-written"]
        print(
            f"| {name} | {r['Mirrored']:.2f}x | {r['FSDP']:.3f}x | {r['hand-written']:.3f}x "
            f"| {ratio:.3f} |"
        )
    # What the scanned blocks keep for the backward pass beyond one block's recomputation:
    # the activations (they scale with the batch), the same in the hand-written step.
    kept = rows[-2][1]["FSDP"] - rows[-1][1]["FSDP"]
    print(
        f"Without remat the scanned transformer's blocks keep {kept:.3f}x one parameter copy "
        f"for the backward pass (the --remat none row minus the --remat full row)."
    )


if __name__ == "__main__":
    main()
