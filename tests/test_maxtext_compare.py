"""benchmarks/maxtext_compare.py without MaxText: its model and its message.

MaxText is never a test dependency: the comparison itself runs in its own environment
(docs/benchmarks.md, "Against MaxText"). Here, in jstrategy's environment, the script's
jstrategy model must have the parameter count of MaxText's decoder (the formula the script
checks both sides against), and the script must say how to install MaxText and stop.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jstrategy.experimental import moe_dropped_fraction

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "maxtext_compare.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("maxtext_compare", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # Registered first: its dataclasses look their module up while they are made.
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


@pytest.mark.parametrize("layers", ["scanned", "unrolled", "repeated"])
def test_the_decoder_has_maxtext_s_parameter_count(layers):
    bench = _load()
    shape = bench.Shape(4)
    model = bench.Decoder(shape, layers=layers)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    counted = sum(leaf.size for leaf in jax.tree.leaves(variables["params"]))
    # 2 * 1024 * 256 (embedding, output) + 4 * (2 * 256 + 4 * 256**2 + 3 * 256 * 1024) + 256
    assert counted == shape.parameters() == 4_720_896


def test_without_maxtext_it_names_the_install_command():
    if importlib.util.find_spec("maxtext") is not None:
        pytest.skip("MaxText is installed here; the message is for environments without it")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "needs MaxText 0.2.5" in result.stderr
    assert "pip install maxtext==0.2.5" in result.stderr
    assert "decoupled-requirements.txt" in result.stderr


def _load_moe(name: str):
    """`benchmarks/<name>.py` (the MoE rows' modules), after the script they extend."""
    _load()
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
def test_the_moe_decoder_has_maxtext_s_parameter_count_and_reports_its_drops(layers):
    moe = _load_moe("_maxtext_moe")
    shape = moe.MoEShape(2, seq=16)
    model = moe.Decoder(shape, layers=layers)
    tokens = jax.random.randint(jax.random.key(1), (4, shape.seq), 0, shape.vocab)
    variables = model.init(jax.random.key(0), tokens[:1])
    counted = sum(leaf.size for leaf in jax.tree.leaves(variables["params"]))
    # 2 * 1024 * 256 + 2 * (2 * 256 + 4 * 256**2 + 256 * 8 + 8 * 3 * 256 * 1024) + 256
    assert counted == shape.parameters() == 13_636_864
    _, state = model.apply(variables, tokens, mutable=["intermediates", "losses"])
    # Each layer's drop counts and load-balancing term reach the collections, scanned too.
    assigned = sum(float(jnp.sum(leaf)) for leaf in _find(state["intermediates"], "assigned"))
    assert assigned == shape.layers * len(tokens) * shape.seq * shape.top_k
    assert 0 < moe_dropped_fraction(state["intermediates"]) < 1
    assert sum(leaf.size for leaf in jax.tree.leaves(state["losses"])) == shape.layers


def _find(tree, key: str) -> list:
    """The leaves under every `key` in a nested mapping."""
    if not hasattr(tree, "items"):
        return []
    return [x for k, v in tree.items() for x in (jax.tree.leaves(v) if k == key else _find(v, key))]


def test_the_topology_row_s_decoder_is_mixtral_8x7b_sized():
    topology = _load_moe("maxtext_moe_topology")
    shape = topology.mixtral_8x7b(32, 4096)
    init = jax.eval_shape(
        topology.moe.Decoder(shape, "scanned").init,
        jax.random.key(0),
        jax.ShapeDtypeStruct((1, 8), jnp.int32),
    )
    counted = sum(leaf.size for leaf in jax.tree.leaves(init["params"]))
    assert counted == shape.parameters() == 46_702_792_704  # Mixtral 8x7B's count


def test_the_largest_batch_option_needs_a_known_chip_and_says_what_does_not_fit():
    """`maxtext_compare.py --topology v5e:4x4 --largest-batch`'s arguments and table, without
    libtpu (the search itself compiles for the slice: docs/benchmarks.md has its table)."""
    topology = _load_moe("maxtext_topology")
    largest = _load_moe("topology_largest_batch")
    with pytest.raises(SystemExit, match="needs --topology, e.g. v5e:4x4"):
        topology.main(["--rows", "7b-fsdp", "--largest-batch"])
    with pytest.raises(SystemExit, match="chip 'v9' has no HBM figure; known: v5p"):
        topology.main(["--topology", "v9:4x4", "--largest-batch"])
    row = largest.on_topology(topology.ROWS["7b-data-tensor"], "v5e:4x4")
    assert (row.topology, row.chips, row.batch) == ("v5e:4x4", 16, 16)
    gib = 2**30
    found = {"largest": 48, "peak": 15 * gib, "compiles": 5, "seconds": 300.0, "caveat": "",
             "verified_peak": 15 * gib}  # fmt: skip
    assert "| v5e:4x4 (16 GiB) | float32 | 48 (3) | 15.00 | 5 | 300 | recompiled at 48: " in (
        largest.format_row(row, "float32", found)
    )
    refused = {"largest": None, "peak": None, "compiles": 3, "seconds": 90.0, "caveat": "",
               "peak_at_given": 17 * gib, "refused": "HLO temporaries (17.00G) exceeds 15.75G",
               "advice": ["Shard the state over more devices"]}  # fmt: skip
    text = largest.format_row(row, "float32", refused)
    assert "| does not fit | - | 3 | 90 | 17.00 GiB at batch 16; the TPU compiler refused" in text
    assert "advice: Shard the state over more devices" in text
