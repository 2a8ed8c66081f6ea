"""Every notebook in colab/ runs top to bottom on 8 fake CPU devices, without errors.

Each notebook is executed by nbclient in a fresh kernel of this very interpreter (a
kernelspec written to a temporary directory points at `sys.executable`, so no installed
kernelspec is needed). Cells tagged ``skip-in-tests`` (the ``%pip install`` cell) are
dropped. The notebooks' own hardware check finds no TPU here and falls back to fake CPU
devices with ``JSTRATEGY_ALLOW_NON_TPU=1``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Older jupyter_core versions warn (DeprecationWarning) unless told to use platformdirs,
# and pytest turns warnings into errors.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")

import nbclient
import nbformat

COLAB = Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
SKIP_TAG = "skip-in-tests"
KERNEL = "jstrategy-tests"
_DEVICE_SETTINGS = ("XLA_FLAGS", "JAX_PLATFORMS", "JSTRATEGY_ALLOW_NON_TPU")


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec for this interpreter, found through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "jstrategy tests", "language": "python"})
    )
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), old]))
    yield KERNEL
    if old is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = old


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"tpu_quickstart.ipynb", "custom_training_loop.ipynb"}


def _install_cell(path):
    nb = nbformat.read(path, as_version=4)
    install = [c for c in nb.cells if SKIP_TAG in c.metadata.get("tags", [])]
    assert len(install) == 1
    return install[0].source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_says_how_to_open_it_installs_by_name_and_checks_hardware(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "File > Upload notebook" in first.source
    install = _install_cell(path)
    assert 'REQUIREMENTS = ["jstrategy", "scikit-learn"]' in install
    assert "git+" not in install  # by name, from the package index
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    check = next(i for i, s in enumerate(sources) if "JSTRATEGY_ALLOW_NON_TPU" in s)
    first_jax = next(i for i, s in enumerate(sources) if "import jax" in s)
    assert check < first_jax  # the fallback is chosen before JAX starts


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_install_cell_keeps_the_runtimes_jax_and_explains_a_failure(path, tmp_path):
    """The install cell, run as Colab would, where the package cannot be found.

    pip gets the installed jax and jaxlib as constraints (so it can never replace them), and
    a package it cannot find ends in a message that says what to do, not a traceback.
    """
    import jax
    import jaxlib

    cell = _install_cell(path).replace(
        'REQUIREMENTS = ["jstrategy", "scikit-learn"]',
        'REQUIREMENTS = ["jstrategy-no-such-package"]',
    )
    script = tmp_path / "install_cell.py"
    script.write_text(cell)
    # No index: pip fails at once, without the network, as it does where the name is unknown.
    env = {
        **os.environ,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "Could not install jstrategy-no-such-package" in result.stdout
    assert f"jax=={jax.__version__}" in result.stdout
    assert f"jaxlib=={jaxlib.__version__}" in result.stdout
    assert "python -m build" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, kernel_name, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if SKIP_TAG not in c.metadata.get("tags", [])]
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=120,  # per cell
        resources={"metadata": {"path": str(tmp_path)}},
    )
    # The kernel starts without this process's device settings: the notebook's own
    # hardware check must choose the fake CPU devices.
    env = {k: v for k, v in os.environ.items() if k not in _DEVICE_SETTINGS}
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "8 fake CPU devices" in text and "8 replicas" in text
