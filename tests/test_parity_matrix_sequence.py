"""The parity matrix's cells of the sequence-split activations (issue 46): `HybridStrategy`
(replicas x FSDP x tensor) with ``tensor_activations="sequence"``, every model of the zoo
(the attention model's remat-marked block has its input's sequence split over
``"tensor"``), each within `parity_zoo.TOLERANCE` of `OneDeviceStrategy`.

The rest of the matrix is `test_parity_matrix.py` and `test_parity_matrix_spec.py`; these
cells run in CI's lane B, two ways each (`parity_zoo.COMBINATION_WAYS`).
"""

from __future__ import annotations

import parity_zoo
import pytest
from test_parity_matrix import _assert_follows
from test_parity_matrix import _oracle

CELLS = [pytest.param(*cell, id="-".join(cell)) for cell in parity_zoo.cells("sequence")]


def test_every_model_is_a_cell_of_the_sequence_split():
    trained = {m for m, _, _, _ in parity_zoo.cells("sequence")}
    assert trained == set(parity_zoo.MODELS)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "where", "path"), CELLS)
def test_every_model_follows_one_device_with_the_sequence_split(model, strategy, where, path):
    got = parity_zoo.train(model, parity_zoo.STRATEGIES[strategy](), where, path)
    _assert_follows(got, _oracle(model, path))
