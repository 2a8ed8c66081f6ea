"""The documentation site (docs/: the README, the guides, the benchmarks, the changelog and
the API reference from Sphinx autodoc + napoleon) builds warning-free, has every public
name with a summary and an example, and none of autodoc's machine-made defects: what
``make docs`` builds, checked in the suite."""

import importlib.util
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
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
    assert (built / "api" / "reference" / "jstrategy.html").is_file()


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
        page = (built / "api" / "reference" / f"{module.__name__}.html").read_text("utf-8")
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
                target = (built / "api" / "reference" / f"{value.__name__}.html").read_text("utf-8")
            count += 1
            if anchor not in target:
                missing.append(f"{module.__name__}.{attr}")
    assert not missing, f"not in the built reference: {missing}"
    assert count >= 140  # the issue counted 140 public names


@pytest.mark.multiprocess
def test_a_docstring_is_rendered(built: Path) -> None:
    """The entries hold the docstrings (napoleon's sections), not just the names."""
    page = (built / "api" / "reference" / "jstrategy.html").read_text(encoding="utf-8")
    start = page.index('id="jstrategy.MirroredStrategy"')
    entry = page[start : start + 20000]
    assert "One replica per device" in entry
    assert "Parameters" in entry


def test_make_docs_and_ci_build_it_as_the_suite_does():
    """`make docs` runs the suite's Sphinx command (warnings are errors), and CI runs it."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "-m sphinx -W --keep-going -q -b html docs docs/_build/html" in makefile
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # The suite (whose lanes build the reference as this file does) runs before it.
    lanes = [ci.index(f"make test-lane-{lane}") for lane in "abcd"]
    assert lanes == sorted(lanes) and lanes[-1] < ci.index("make docs")


@pytest.mark.multiprocess
def test_the_site_has_the_readme_the_guides_and_the_changelog(built: Path) -> None:
    """The index is the README and links every guide; each guide, the benchmarks and the
    changelog are pages of the site beside the reference."""
    index = (built / "index.html").read_text(encoding="utf-8")
    assert "The seed program, line by line" in index and "Quick start" in index
    guides = sorted(p.stem for p in (ROOT / "docs" / "guides").glob("*.md"))
    assert len(guides) >= 13
    for guide in guides:
        assert (built / "guides" / f"{guide}.html").is_file()
        assert f'href="guides/{guide}.html' in index, guide
    assert 'href="api/index.html"' in index
    changelog = (built / "changelog.html").read_text(encoding="utf-8")
    assert "0.1.0" in changelog
    assert "Total params: 193" in (built / "index.html").read_text(encoding="utf-8")


# What autodoc shows when left to itself: Flax's `parent` default, Python's docstring of a
# method without one, and the docstring of a constant's type.
MACHINE_MADE = {
    "_Sentinel": "Flax's parent=<_Sentinel> in a layer's signature",
    "Call self as a function": "a __call__ without a docstring",
    "Create a new string object": "str's docstring on a constant",
    "Convert a number or string to an integer": "int's docstring on a constant",
    "Built-in immutable sequence": "tuple's docstring on a constant",
}


@pytest.mark.multiprocess
def test_the_reference_has_no_machine_made_text(built: Path) -> None:
    found = [
        f"{page.relative_to(built)}: {why}"
        for page in sorted(built.rglob("*.html"))
        if "_modules" not in page.parts and "_sources" not in page.parts
        for marker, why in MACHINE_MADE.items()
        if marker in page.read_text(encoding="utf-8")
    ]
    assert not found, found
    layers = (built / "api" / "reference" / "jstrategy.layers.html").read_text("utf-8")
    # The layers' constructor checks are Flax's business, not the reader's.
    assert 'id="jstrategy.layers.Dense.validate"' not in layers
    # A constant shows its own description and value.
    page = (built / "api" / "reference" / "jstrategy.html").read_text(encoding="utf-8")
    start = page.index('id="jstrategy.REPLICA_AXIS"')
    assert "The name of the mesh axis" in page[start : start + 3000]


def test_every_public_name_has_a_summary_and_an_example() -> None:
    """Every class and function in the reference opens with a summary line and shows a
    doctest (run by the suite: ``--doctest-modules`` over jstrategy/); every constant has
    a ``#:`` comment where it is defined (`constant_doc` fails the build otherwise)."""
    conf = _conf()
    seen: set[int] = set()
    missing = []
    for module in conf.public_modules():
        for attr in conf.public_names(module):
            value = getattr(module, attr)
            if isinstance(value, types.ModuleType) or id(value) in seen:
                continue
            seen.add(id(value))
            name = f"{module.__name__}.{attr}"
            if not (inspect.isclass(value) or inspect.isroutine(value)):
                assert "".join(conf.constant_doc(module, attr)).strip(), name
                continue
            doc = inspect.getdoc(value) or ""
            summary = doc.strip().split("\n", 1)[0]
            if not re.match(r"[A-Z`\"'(]", summary) or ">>>" not in doc:
                missing.append(name)
    assert not missing, f"without a summary line or an example: {missing}"
