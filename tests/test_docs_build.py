"""The API reference (docs/api, Sphinx autodoc + napoleon) builds warning-free and has
every public name: what ``make docs`` builds, checked in the suite."""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "api"
# -W: any Sphinx or docutils warning (bad docstring markup, a name autodoc cannot import)
# fails the build; --keep-going reports them all at once. The Makefile's `docs` target too.
SPHINX = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]


def _conf() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("jstrategy_docs_conf", DOCS / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        import furo  # noqa: F401
        import sphinx  # noqa: F401
    except ImportError as error:  # a test environment without the docs extra is incomplete
        pytest.fail(f"{error}; install the docs tools: pip install -e '.[docs]' (or '.[dev]')")
    out = tmp_path_factory.mktemp("html")
    result = subprocess.run(
        [*SPHINX, "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.mark.multiprocess
def test_reference_builds_without_warnings(built: Path) -> None:
    assert (built / "index.html").is_file()
    assert (built / "reference" / "jstrategy.html").is_file()


@pytest.mark.multiprocess
def test_every_public_name_is_in_the_reference(built: Path) -> None:
    conf = _conf()
    modules = conf.public_modules()
    names = {m.__name__ for m in modules}
    # The namespaces of the issue, and the submodules their __all__ name, are all walked.
    assert {
        "jstrategy",
        "jstrategy.experimental",
        "jstrategy.experimental.partitioners",
        "jstrategy.optimizers",
        "jstrategy.optimizers.schedules",
        "jstrategy.training",
        "jstrategy.coordinator",
        "jstrategy.tpu.experimental",
        "jstrategy.launch",
        "jstrategy.layers",
        "jstrategy.regularizers",
    } <= names
    missing = []
    count = 0
    for module in modules:
        page = (built / "reference" / f"{module.__name__}.html").read_text(encoding="utf-8")
        if f'id="module-{module.__name__}"' not in page:
            missing.append(module.__name__)
        for attr in conf.public_names(module):
            value = getattr(module, attr)
            anchor = (
                f'id="module-{value.__name__}"'
                if isinstance(value, types.ModuleType)
                else f'id="{module.__name__}.{attr}"'
            )
            target = page
            if isinstance(value, types.ModuleType):
                target = (built / "reference" / f"{value.__name__}.html").read_text("utf-8")
            count += 1
            if anchor not in target:
                missing.append(f"{module.__name__}.{attr}")
    assert not missing, f"not in the built reference: {missing}"
    assert count >= 140  # the issue counted 140 public names


@pytest.mark.multiprocess
def test_a_docstring_is_rendered(built: Path) -> None:
    """The entries hold the docstrings (napoleon's sections), not just the names."""
    page = (built / "reference" / "jstrategy.html").read_text(encoding="utf-8")
    start = page.index('id="jstrategy.MirroredStrategy"')
    entry = page[start : start + 20000]
    assert "One replica per device" in entry
    assert "Parameters" in entry


def test_make_docs_and_ci_build_it_as_the_suite_does():
    """`make docs` runs the suite's Sphinx command (warnings are errors), and CI runs it."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "-m sphinx -W --keep-going -q -b html docs/api docs/_build/html" in makefile
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # The suite (whose lanes build the reference as this file does) runs before it.
    assert ci.index("make test-lane-a") < ci.index("make test-lane-b") < ci.index("make docs")
