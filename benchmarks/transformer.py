"""Transformer LM training: tokens/s and model FLOPs utilization, float32 vs mixed_bfloat16.

One training step of `examples/transformer_lm.py`'s decoder-only transformer (AdamW,
`jstrategy.training.create_train_state` + `make_train_step`), for each dtype policy under
OneDeviceStrategy and MirroredStrategy over all devices, side by side in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/transformer.py --size tiny
    python benchmarks/transformer.py --size 350m        # one accelerator (H100/H200 class)

Model FLOPs (PaLM, Chowdhery et al. 2022, appendix B), forward plus backward:

    FLOPs per token = 6 * N + 12 * n_layers * d_model * seq_len
    FLOPs per step  = global_batch * seq_len * FLOPs per token

N is the number of parameters (the tied token embedding counted once: it is also the
output projection; position embeddings and LayerNorm parameters, ~0.3% of the 350m
preset, do no matrix work and are counted anyway). The second term is the attention
score and value matmuls (2 * 2 * seq_len * d_model per token and layer forward, times
3 for forward plus backward), counted in full: causal masking is NOT credited as halving
it, as in PaLM's and Megatron's MFU. Rematerialization is not counted (none is used).

MFU = achieved model FLOP/s / (peak FLOP/s per device * devices in the strategy), with the
dense peak for the dtype the matrix units run (`PEAK_TFLOPS`). float32 matmuls run as
TF32 on NVIDIA GPUs and as one bfloat16 pass on TPUs under JAX's default matmul precision,
so those are their peaks; with ``jax_default_matmul_precision="highest"`` a GPU's FP32
peak is used. On CPUs MFU is printed as n/a: the fake devices share a few cores and no
datasheet peak applies (``--peak-tflops`` supplies one for any device).

Each policy is given to `create_train_state` and `make_train_step` (``dtype_policy=``):
parameters and optimizer state stay float32, the step casts them and the inputs to the
compute dtype inside the differentiated function (the model's ``dtype`` is None, so it
follows), and the logits to float32 for the loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm

import jstrategy
from jstrategy import mixed_precision
from jstrategy import training
from jstrategy._src import dispatch


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: int
    batch_size: int  # per replica
    steps: int
    warmup: int


PRESETS = {
    # Seconds on a CPU with 8 fake devices.
    "tiny": Preset(256, 64, 2, 4, 64, 4, batch_size=2, steps=10, warmup=2),
    # GPT-2 medium's shape (~355M parameters, vocabulary padded to a multiple of 128).
    # 16 x 1024 tokens per step makes every matmul at least 16384 x 1024 x 1024.
    "350m": Preset(50304, 1024, 24, 16, 1024, 4, batch_size=16, steps=20, warmup=3),
}

# Dense (no sparsity) peak TFLOP/s per device, by the matrix units' input type. NVIDIA's
# datasheets quote tensor-core rates "with sparsity"; the dense rate is half of that.
# The first key contained in `jax.Device.device_kind` wins, so specific names come first.
#   H100/H200 SXM: NVIDIA H100 datasheet (SXM5) and H200 datasheet (SXM): BF16 1,979
#     (sparse), TF32 989 (sparse), FP32 67. NVL: BF16 1,671, TF32 835, FP32 60. H100
#     PCIe: BF16 1,513, TF32 756, FP32 51.
#   A100 (SXM4 and PCIe): NVIDIA A100 datasheet: BF16 312, TF32 156, FP32 19.5 (dense).
#   TPUs, bfloat16 per chip (one JAX device each): Cloud TPU documentation, "System
#     architecture": v4 275, v5e 197, v5p 459, v6e (Trillium) 918.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "TPU v6 lite": {"bf16": 918.0},
    "TPU v5 lite": {"bf16": 197.0},
    "TPU v5": {"bf16": 459.0},
    "TPU v4": {"bf16": 275.0},
}

POLICIES = ("float32", "mixed_bfloat16")
STRATEGIES = ("one_device", "mirrored")


def param_count(p: Preset) -> int:
    """Parameters of `transformer_lm.TransformerLM` (no biases in Dense layers, tied output)."""
    d = p.d_model
    per_block = 4 * d * d + 2 * p.mlp_ratio * d * d + 2 * 2 * d  # attn, MLP, two LayerNorms
    return p.vocab_size * d + p.seq_len * d + p.n_layers * per_block + 2 * d


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> int:
    """Model FLOPs per token, forward plus backward: ``6 N + 12 L d T`` (PaLM)."""
    return 6 * n_params + 12 * n_layers * d_model * seq_len


def matmul_input_type(policy: str, platform: str) -> str:
    """What the matrix units consume for `policy` on `platform`: a `PEAK_TFLOPS` key."""
    if mixed_precision.Policy(policy).compute_dtype == "bfloat16":
        return "bf16"
    precision = str(getattr(jax.config, "jax_default_matmul_precision", None) or "default").lower()
    full = precision in ("highest", "float32")
    if platform == "tpu":
        return "fp32" if full else "bf16"  # no TPU fp32 entry: n/a under "highest"
    if platform == "gpu":
        return "fp32" if full else "tf32"
    return "fp32"


def peak_tflops(device_kind: str, input_type: str) -> float | None:
    """The dense peak TFLOP/s of one device of `device_kind`, or None if unknown."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_kind:
            return peaks.get(input_type)
    return None


@dataclasses.dataclass
class Row:
    policy: str
    strategy: str
    devices: int
    global_batch: int
    step_s: float
    tokens_per_s: float
    tflops: float  # achieved model TFLOP/s, all devices together
    mfu: float | None
    first_step_s: float
    attention: str
    error: str = ""


def build_step(preset: Preset, policy: str, strategy: Any, attention: str):
    """The train state and compiled step for one (policy, strategy)."""
    model = transformer_lm.TransformerLM(
        vocab_size=preset.vocab_size,
        d_model=preset.d_model,
        n_layers=preset.n_layers,
        n_heads=preset.n_heads,
        seq_len=preset.seq_len,
        mlp_ratio=preset.mlp_ratio,
        attention=attention,  # dtype None: the model computes in the policy's dtype
    )
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    with strategy.scope():
        # A short sample: initialization needs shapes only, and the position table's
        # size comes from seq_len.
        sample = jnp.zeros((1, min(8, preset.seq_len)), jnp.int32)
        state = training.create_train_state(model, tx, sample, rng=0, dtype_policy=policy)
        step = training.make_train_step(transformer_lm.lm_loss, dtype_policy=policy)
    return state, step


def measure(
    preset: Preset,
    policy: str,
    strategy_name: str,
    *,
    steps: int,
    warmup: int,
    batch_size: int,
    attention: str,
    peak: float | None,
) -> Row:
    strategy = (
        jstrategy.OneDeviceStrategy(jax.devices()[0])
        if strategy_name == "one_device"
        else jstrategy.MirroredStrategy()
    )
    n = strategy.num_replicas_in_sync
    state, step = build_step(preset, policy, strategy, attention)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    if n_params != param_count(preset):
        raise AssertionError(f"{n_params} parameters, but param_count says {param_count(preset)}")
    global_batch = batch_size * n
    rows = np.random.default_rng(0).integers(
        0, preset.vocab_size, size=(global_batch, preset.seq_len + 1), dtype=np.int32
    )
    split = strategy.batch_sharding()
    batch = (jax.device_put(rows[:, :-1], split), jax.device_put(rows[:, 1:], split))

    start = time.perf_counter()
    state, metrics = step(state, batch)  # compiles
    jax.block_until_ready(metrics)
    first_step_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        state, metrics = step(state, batch)
        dispatch.track(metrics)
    jax.block_until_ready((state, metrics))

    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
        dispatch.track(metrics)  # bounded steps in flight, no sync per step
    jax.block_until_ready((state, metrics))
    step_s = (time.perf_counter() - start) / steps
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss}")

    tokens = global_batch * preset.seq_len
    flops = tokens * flops_per_token(n_params, preset.n_layers, preset.d_model, preset.seq_len)
    tflops = flops / step_s / 1e12
    return Row(
        policy=policy,
        strategy=strategy_name,
        devices=n,
        global_batch=global_batch,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        tflops=tflops,
        mfu=None if peak is None else tflops / (peak * n),
        first_step_s=first_step_s,
        attention=_resolved_attention(attention, policy, preset),
    )


def _resolved_attention(attention: str, policy: str, preset: Preset) -> str:
    if attention != "auto":
        return attention
    dtype = mixed_precision.Policy(policy).compute_dtype
    return transformer_lm.attention_implementation(dtype, preset.d_model // preset.n_heads)


HEADER = (
    "| dtype policy | strategy | devices | global batch | step ms | tokens/s | model TFLOP/s "
    "| MFU | first step s | attention |"
)


def format_row(row: Row) -> str:
    if row.error:
        return f"| {row.policy} | {row.strategy} | FAILED: {row.error} |"
    mfu = "n/a" if row.mfu is None else f"{100 * row.mfu:.1f}%"
    return (
        f"| {row.policy} | {row.strategy} | {row.devices} | {row.global_batch} | "
        f"{1e3 * row.step_s:.2f} | {row.tokens_per_s:,.0f} | {row.tflops:.4g} | {mfu} | "
        f"{row.first_step_s:.1f} | {row.attention} |"
    )


def _csv(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(
            f"{flag} must be a comma-separated subset of {list(allowed)}; got {value!r}"
        )
    return items


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--dtypes", default=",".join(POLICIES), help="subset of " + ",".join(POLICIES)
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="subset of " + ",".join(STRATEGIES)
    )
    parser.add_argument("--steps", type=int, help="timed steps (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="untimed steps, the first compiles (>= 1)")
    parser.add_argument("--batch-size", type=int, help="sequences per replica (default: preset's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: preset's)")
    parser.add_argument(
        "--attention",
        choices=["auto", "xla", "cudnn"],
        default="auto",
        help="jax.nn.dot_product_attention implementation; auto: cuDNN on GPU in bfloat16",
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="peak TFLOP/s per device, instead of the table's"
    )
    parser.add_argument(
        "--compilation-cache",
        help="directory for JAX's persistent compilation cache: "
        "OneDevice and Mirrored over one GPU compile the same program, so the second is a hit",
    )
    args = parser.parse_args(argv)
    policies = _csv(args.dtypes, POLICIES, "--dtypes")
    strategies = _csv(args.strategies, STRATEGIES, "--strategies")
    preset = PRESETS[args.size]
    if args.seq_len is not None:
        preset = dataclasses.replace(preset, seq_len=args.seq_len)
    steps = args.steps if args.steps is not None else preset.steps
    warmup = args.warmup if args.warmup is not None else preset.warmup
    batch_size = args.batch_size if args.batch_size is not None else preset.batch_size
    if steps < 1 or warmup < 1 or batch_size < 1:
        raise SystemExit("--steps, --warmup and --batch-size must be at least 1.")
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # the big programs

    device = jax.devices()[0]
    n_params = param_count(preset)
    per_token = flops_per_token(n_params, preset.n_layers, preset.d_model, preset.seq_len)
    tokens = batch_size * preset.seq_len
    print(f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind} ({device.platform})")
    print(
        f"preset {args.size}: vocab {preset.vocab_size}, d_model {preset.d_model}, "
        f"{preset.n_layers} layers, {preset.n_heads} heads, seq {preset.seq_len}, "
        f"mlp x{preset.mlp_ratio}, tied embeddings"
    )
    print(f"parameters: {n_params:,}")
    print(
        f"model FLOPs per token: 6 * {n_params:,} + 12 * {preset.n_layers} * {preset.d_model} "
        f"* {preset.seq_len} = {per_token:,}"
    )
    print(
        f"model FLOPs per step per replica ({batch_size} x {preset.seq_len} tokens): "
        f"{tokens * per_token:.4e}"
    )
    print(f"{steps} timed steps after {warmup} warm-up step(s); batch {batch_size} per replica")
    peaks = {}
    for policy in policies:
        kind = matmul_input_type(policy, device.platform)
        peak = args.peak_tflops if args.peak_tflops else peak_tflops(device.device_kind, kind)
        peaks[policy] = peak
        source = "--peak-tflops" if args.peak_tflops else f"{kind} dense"
        shown = "n/a (no datasheet peak for this device)" if peak is None else f"{peak:g}"
        print(f"peak TFLOP/s per device for {policy}: {shown} [{source}]")
    print()
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")

    rows = []
    for policy in policies:
        for strategy_name in strategies:
            attention = args.attention
            while True:
                try:
                    row = measure(
                        preset,
                        policy,
                        strategy_name,
                        steps=steps,
                        warmup=warmup,
                        batch_size=batch_size,
                        attention=attention,
                        peak=peaks[policy],
                    )
                except Exception as e:  # one failing configuration must not hide the others
                    if (
                        attention == "auto"
                        and _resolved_attention(attention, policy, preset) == "cudnn"
                    ):
                        print(f"(cuDNN attention failed, retrying with XLA's: {_short(e)})")
                        attention = "xla"
                        continue
                    row = Row(policy, strategy_name, 0, 0, 0, 0, 0, None, 0, attention, _short(e))
                break
            rows.append(row)
            print(format_row(row), flush=True)
    _print_ratios(rows)
    _print_memory(device)
    return rows


def _print_memory(device: Any) -> None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # not every backend reports memory
        stats = {}
    if "peak_bytes_in_use" in stats:
        print(
            f"device 0 memory: peak {stats['peak_bytes_in_use'] / 2**30:.1f} GiB in use of "
            f"{stats.get('bytes_limit', 0) / 2**30:.1f} GiB"
        )


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


def _print_ratios(rows: list[Row]) -> None:
    by_key = {(r.policy, r.strategy): r for r in rows if not r.error}
    print()
    for strategy in STRATEGIES:
        f32, bf16 = by_key.get(("float32", strategy)), by_key.get(("mixed_bfloat16", strategy))
        if f32 and bf16:
            print(
                f"{strategy}: mixed_bfloat16 runs {bf16.tokens_per_s / f32.tokens_per_s:.2f}x "
                "the tokens/s of float32"
            )
    for policy in POLICIES:
        one, mirrored = by_key.get((policy, "one_device")), by_key.get((policy, "mirrored"))
        if one and mirrored:
            print(
                f"{policy}: Mirrored over {mirrored.devices} device(s) runs "
                f"{mirrored.tokens_per_s / one.tokens_per_s:.2f}x the tokens/s of OneDevice"
            )


if __name__ == "__main__":
    results = main()
    raise SystemExit(1 if any(r.error for r in results) else 0)
