"""`benchmarks/fit_cost.py`, the cost guard of `Model.fit`'s host time per step (issue 39),
runs end to end and prints its table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fit_cost_prints_one_row_per_configuration(capsys):
    spec = importlib.util.spec_from_file_location("fit_cost", ROOT / "benchmarks/fit_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    host = bench.main(["--repeat-data", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = {
        line.split("  ")[1].strip(): line
        for line in out.splitlines()
        if line.startswith("  ") and "configuration" not in line
    }
    assert list(rows) == list(host)
    assert bench.BARE_LOOP in rows and "fit, steps_per_execution=8" in rows
    assert len(rows) == 11
    for name, line in rows.items():
        # host us/step, its ratio to the bare loop, wall us/step
        numbers = re.findall(r"(\d+(?:\.\d+)?)x?", line[len(name) + 2 :])
        assert len(numbers) == 3, line
        assert host[name] > 0
    assert re.search(rf"{re.escape(bench.BARE_LOOP)}\s+\d+\s+1\.00x", out)
