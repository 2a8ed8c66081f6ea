"""benchmarks/maxtext_compare.py without MaxText: its model and its message.

MaxText is never a test dependency: the comparison itself runs in its own environment
(docs/benchmarks.md, "Against MaxText"). Here, in jstrategy's environment, the script's
jstrategy model must have the parameter count of MaxText's decoder (the formula the script
checks both sides against), and the script must say how to install MaxText and stop.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

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
