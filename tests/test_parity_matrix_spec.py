"""The parity matrix's cells of the parallelism spec's combinations (issue 47): pipeline x
FSDP x tensor, context x tensor and context x FSDP x tensor, every model of the zoo (a model
whose attention runs as a ring over the context axis among them), and that model under
every other strategy; each within `parity_zoo.TOLERANCE` of `OneDeviceStrategy`.

The rest of the matrix is `test_parity_matrix.py`; these cells run in CI's lane C, beside
the pipelines and long sequences, two ways each (`parity_zoo.COMBINATION_WAYS`).
"""

from __future__ import annotations

import parity_zoo
import pytest
from test_parity_matrix import _assert_follows
from test_parity_matrix import _oracle

CELLS = [pytest.param(*cell, id="-".join(cell)) for cell in parity_zoo.cells("combinations")]


def test_the_combinations_are_cells_of_the_matrix():
    """Each combination trains every model but those it refuses (no Repeated block for a
    pipeline), and the attention model trains under every strategy."""
    cells = {(m, s) for m, s, _, _ in parity_zoo.cells("combinations")}
    for strategy in parity_zoo.COMBINATIONS:
        trained = {m for m, s in cells if s == strategy}
        refused = {m for m in parity_zoo.MODELS if parity_zoo.refusal(m, strategy)}
        assert trained | refused == set(parity_zoo.MODELS)
    grouped = cells | {(m, s) for m, s, _, _ in parity_zoo.cells("sequence")}
    for strategy in set(parity_zoo.STRATEGIES) - {"one_device"}:
        assert ("attention", strategy) in grouped or parity_zoo.refusal("attention", strategy)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "where", "path"), CELLS)
def test_every_model_follows_one_device_under_the_combinations(model, strategy, where, path):
    got = parity_zoo.train(model, parity_zoo.STRATEGIES[strategy](), where, path)
    _assert_follows(got, _oracle(model, path))
