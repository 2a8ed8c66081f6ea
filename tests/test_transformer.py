"""The transformer example (`examples/transformer_lm.py`) and its benchmark (smoke test)."""

import functools
import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import mixed_precision

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


lm = _load("transformer_lm", "examples/transformer_lm.py")
bench = _load("transformer_bench", "benchmarks/transformer.py")

SMALL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32}


@functools.cache
def _one_device_losses(steps=20):
    model = lm.TransformerLM(**SMALL)
    return lm.train(jstrategy.OneDeviceStrategy("cpu:0"), model, steps=steps, batch_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mirrored", "fsdp", "megatron"])
def test_loss_falls_and_strategies_agree(strategy):
    model = lm.TransformerLM(**SMALL)
    one = _one_device_losses()
    losses = lm.train(lm.STRATEGIES[strategy](), model, steps=20, batch_size=16)
    for run in (one, losses):
        assert run[0] == pytest.approx(np.log(SMALL["vocab_size"]), rel=0.05)
        assert np.mean(run[-3:]) < 0.8 * run[0]
    # The same global batches: the same trajectory on 1 and 8 devices, with the
    # parameters replicated, split over every device, or split Megatron-style.
    np.testing.assert_allclose(losses, one, rtol=1e-5)


def test_megatron_layout_splits_attention_heads_and_the_mlp():
    strategy = lm.megatron_strategy()
    assert dict(strategy.mesh.shape) == {"batch": 2, "model": 4}
    params = jax.eval_shape(
        lm.TransformerLM(**SMALL).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
    )["params"]
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = tuple(k.key for k in path)
        specs["/".join(names)] = strategy.variable_sharding(leaf, ("params", *names)).spec
    for name in ("query", "key", "value"):
        assert specs[f"blocks_1/attn/{name}/kernel"] == P(None, "model")
    assert specs["blocks_1/attn/out/kernel"] == P("model", None)
    assert specs["blocks_0/mlp/up/kernel"] == P(None, "model")
    assert specs["blocks_0/mlp/down/kernel"] == P("model", None)
    assert specs["embed/embedding"] == specs["blocks_0/ln1/scale"] == P()


def test_parameter_names_are_regular():
    """Layouts (FSDP, Megatron layout maps) are regexes over these paths."""
    model = lm.TransformerLM(**SMALL)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    paths = {
        "/".join(k.key for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    d, r = SMALL["d_model"], 4
    expected = {"embed/embedding": (64, d), "pos_embed/embedding": (32, d)}
    expected |= {"ln_f/scale": (d,), "ln_f/bias": (d,)}
    for i in range(SMALL["n_layers"]):
        b = f"blocks_{i}"
        expected |= {f"{b}/attn/{n}/kernel": (d, d) for n in ("query", "key", "value", "out")}
        expected |= {f"{b}/mlp/up/kernel": (d, r * d), f"{b}/mlp/down/kernel": (r * d, d)}
        expected |= {f"{b}/{ln}/{p}": (d,) for ln in ("ln1", "ln2") for p in ("scale", "bias")}
    assert paths == expected


@pytest.mark.slow
def test_scanned_layers_megatron_and_remat_give_the_same_steps(capsys):
    """--scan-layers: one nn.scan over the blocks, stacked kernels split Megatron-style on
    their (head, MLP) dimension; --remat recomputes each block without changing a step."""
    model = lm.TransformerLM(**SMALL, scan_layers=True)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    d, n = SMALL["d_model"], SMALL["n_layers"]
    assert params["blocks"]["attn"]["query"]["kernel"].shape == (n, d, d)
    assert params["blocks"]["mlp"]["up"]["kernel"].shape == (n, d, 4 * d)
    strategy = lm.megatron_strategy(scan_layers=True)
    leaf = params["blocks"]["attn"]["out"]["kernel"]
    spec = strategy.variable_sharding(leaf, ("params", "blocks", "attn", "out", "kernel")).spec
    assert spec == P(None, "model", None)
    plain = lm.train(strategy, model, steps=6, batch_size=16)
    rematted = lm.train(
        lm.megatron_strategy(scan_layers=True), model, steps=6, batch_size=16, remat=True
    )
    np.testing.assert_allclose(rematted, plain, rtol=1e-6)
    assert plain[-1] < plain[0]
    flags = ["--strategy", "one_device", "--steps", "1", "--scan-layers", "--remat", "full"]
    lm.main([*flags, "--d-model", "16", "--seq-len", "8", "--vocab-size", "16"])
    assert "scanned blocks, remat full" in capsys.readouterr().out
    # --remat auto (the default): the matmul outputs kept for scanned blocks, nothing for
    # unrolled ones.
    small = ["--strategy", "one_device", "--steps", "1", "--d-model", "16", "--seq-len", "8"]
    lm.main([*small, "--vocab-size", "16", "--scan-layers"])
    assert "scanned blocks, remat dots_with_no_batch_dims_saveable" in capsys.readouterr().out
    lm.main([*small, "--vocab-size", "16"])
    assert "unrolled blocks, remat none" in capsys.readouterr().out


@pytest.mark.slow
def test_compute_dtype_and_float32_loss():
    model = lm.TransformerLM(**SMALL, dtype=jnp.bfloat16)
    tokens = jnp.asarray(lm.make_data(2, 8, SMALL["vocab_size"]))
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    logits = model.apply({"params": params}, tokens[:, :-1])
    assert logits.dtype == jnp.bfloat16
    loss = lm.lm_loss(tokens[:, 1:], logits)
    assert loss.shape == (2,) and loss.dtype == jnp.float32
    # The default dtype=None follows a precision policy's casts instead.
    plain = lm.TransformerLM(**SMALL)
    assert plain.apply({"params": params}, tokens[:, :-1]).dtype == jnp.float32
    cast = mixed_precision.cast_to_compute(params, "mixed_bfloat16")
    assert plain.apply({"params": cast}, tokens[:, :-1]).dtype == jnp.bfloat16
    assert lm.attention_implementation(jnp.bfloat16, 64) == (
        "cudnn" if jax.default_backend() == "gpu" else "xla"
    )
    assert lm.attention_implementation(jnp.float32, 64) == "xla"


def test_generated_language_is_deterministic_and_structured():
    a = lm.make_data(4, 15, 50, seed=3)
    np.testing.assert_array_equal(a, lm.make_data(4, 15, 50, seed=3))
    assert a.shape == (4, 16) and a.dtype == np.int32 and a.min() >= 0 and a.max() < 50
    np.testing.assert_array_equal(a[:, 8:], a[:, :8])  # the second half repeats the first
    assert not np.array_equal(a, lm.make_data(4, 15, 50, seed=4))


def test_flops_formula_by_hand():
    p = bench.Preset(10, 4, 1, 2, 8, 4, batch_size=2, steps=1, warmup=1)
    # embed 10*4 + positions 8*4 + one block (q, k, v, out 4*4*4; up, down 2*4*16;
    # two LayerNorms 2*2*4) + final LayerNorm 2*4.
    assert bench.param_count(p) == 40 + 32 + (64 + 128 + 16) + 8 == 288
    model = lm.TransformerLM(10, 4, 1, 2, 8)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == 288
    # 6 N + 12 L d T per token.
    assert bench.flops_per_token(288, 1, 4, 8) == 6 * 288 + 12 * 1 * 4 * 8 == 2112
    assert bench.param_count(bench.PRESETS["350m"]) == 354_650_112


def test_peak_table():
    assert bench.peak_tflops("NVIDIA H200", "bf16") == 989.5
    assert bench.peak_tflops("NVIDIA H200 NVL", "bf16") == 835.5
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 494.5
    assert bench.peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert bench.peak_tflops("TPU v5 lite", "bf16") == 197.0
    assert bench.peak_tflops("TPU v4", "fp32") is None
    assert bench.peak_tflops("cpu", "fp32") is None
    assert bench.matmul_input_type("mixed_bfloat16", "gpu") == "bf16"
    assert bench.matmul_input_type("float32", "gpu") == "tf32"
    assert bench.matmul_input_type("float32", "tpu") == "bf16"
    with jax.default_matmul_precision("highest"):
        assert bench.matmul_input_type("float32", "gpu") == "fp32"


@pytest.mark.slow
def test_tiny_benchmark_smoke(capsys):
    """The CPU preset runs end to end; its table reports MFU from the FLOPs formula."""
    peak = 2.0  # --peak-tflops: CPUs have no datasheet peak, so MFU is n/a without it
    rows = bench.main(["--size", "tiny", "--steps", "2", "--warmup", "1", "--peak-tflops", "2"])
    out = capsys.readouterr().out
    p = bench.PRESETS["tiny"]
    n_params = bench.param_count(p)
    per_token = 6 * n_params + 12 * p.n_layers * p.d_model * p.seq_len
    assert f"parameters: {n_params:,}" in out
    assert f"= {per_token:,}" in out
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "dtype policy", "strategy", "devices", "global batch", "step ms", "tokens/s",
        "model TFLOP/s", "MFU", "first step s", "attention",
    ]  # fmt: skip
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [(r[0], r[1]) for r in table] == [
        ("float32", "one_device"),
        ("float32", "mirrored"),
        ("mixed_bfloat16", "one_device"),
        ("mixed_bfloat16", "mirrored"),
    ]
    assert all(len(r) == len(header) for r in table)
    for row, printed in zip(rows, table, strict=True):
        assert not row.error
        devices = 1 if row.strategy == "one_device" else jax.device_count()
        assert row.devices == devices and row.global_batch == p.batch_size * devices
        tokens = row.global_batch * p.seq_len
        assert row.tokens_per_s == pytest.approx(tokens / row.step_s)
        assert row.tflops == pytest.approx(tokens * per_token / row.step_s / 1e12)
        assert row.mfu == pytest.approx(row.tflops / (peak * devices))
        assert printed[7] == f"{100 * row.mfu:.1f}%"
        assert float(printed[6]) == pytest.approx(row.tflops, rel=1e-3)
        assert re.fullmatch(r"[\d,]+", printed[5]) and printed[9] == "xla"
    assert "mixed_bfloat16 runs" in out and "Mirrored over 8 device(s) runs" in out
