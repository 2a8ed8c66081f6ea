"""The sdist and wheel, built and checked as PyPI would check them.

`python -m build` (without isolation: the backend is a dev dependency, so nothing is
downloaded) makes both from a copy of the checkout; `twine check` validates their metadata
and README. The sdist must carry what its tests read (examples, benchmarks, notebooks, the
root conftest.py), the wheel only the library, and the declared ranges must be the ones the
two CI lanes test.
"""

import datetime
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _copy_of_the_checkout(dest):
    # A copy, so that the build's egg-info and build/ never touch the working tree.
    ignore = shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "wip"
    )
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    src = _copy_of_the_checkout(tmp_path_factory.mktemp("checkout") / "jstrategy")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", out],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=240,
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_twine_check_passes(dist):
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2


@pytest.mark.multiprocess
def test_sdist_carries_what_its_tests_import(dist):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "conftest.py", "pyproject.toml", "Makefile"} <= names
    assert {
        "tests/conftest.py",
        "tests/test_model.py",
        "tests/data/golden_trajectories.npz",
    } <= names
    # What the tests load by path: the examples, a benchmark, the notebooks, the CI lanes.
    assert {"examples/digits.py", "examples/custom_training_tutorial.py"} <= names
    assert {"benchmarks/memory.py", "benchmarks/sharded_step.py"} <= names
    assert {"colab/tpu_quickstart.ipynb", ".ci/oldest-constraints.txt"} <= names
    assert not [n for n in names if n.startswith("wip/") or n.endswith(".pyc")]
    # The documentation's sources (tests/test_docs_build.py builds them, test_docs_pages.py
    # runs them), not what a build generated in the checkout.
    assert {"docs/conf.py", "docs/index.md", "docs/api/index.rst"} <= names
    assert {"docs/guides/getting-started.md", "docs/benchmarks.md"} <= names
    assert not [n for n in names if n.startswith(("docs/_build/", "docs/api/reference/"))]


@pytest.mark.multiprocess
def test_wheel_holds_the_library_its_license_and_the_tested_ranges(dist):
    _, wheel = dist
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(whl.read(metadata).decode())
    assert "jstrategy/__init__.py" in names and "jstrategy/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    assert "jax<0.13,>=0.10.2" in requires and "jaxlib<0.13,>=0.10.2" in requires
    assert any(r.startswith("jax[cuda12]") and 'extra == "cuda"' in r for r in requires)
    assert any(r.startswith("jax[tpu]") and 'extra == "tpu"' in r for r in requires)
    assert meta["Requires-Python"] == ">=3.11"
    assert any(r.startswith("sphinx>=") and 'extra == "docs"' in r for r in requires)


def test_the_oldest_lane_pins_every_declared_floor():
    """`.ci/oldest-constraints.txt` pins exactly the floors pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        name, _, spec = requirement.partition(">=")
        if spec and name != "numpy":
            floors[name] = spec.split(",")[0]
    pins = {}
    for line in (ROOT / ".ci" / "oldest-constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    assert pins == floors


def test_no_placeholder_urls_in_docs_notebooks_or_tests():
    files = [ROOT / "README.md", *ROOT.glob("colab/*.ipynb"), *ROOT.glob("docs/**/*.md")]
    files += [p for p in ROOT.glob("tests/*.py") if p.name != "test_packaging.py"]
    placeholders = ("your-org", "your_org", "<owner>", "example.com/jstrategy")
    found = [(p.name, s) for p in files for s in placeholders if s in p.read_text()]
    assert not found


RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def test_the_version_follows_the_changelog():
    """pyproject's version (and `jstrategy.__version__`) is the newest dated release in
    CHANGELOG.md, or a development release of a later version while work lands after it;
    the changelog keeps an `Unreleased` section on top and stays short."""
    import jstrategy

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 25_000, "CHANGELOG.md: keep entries to one to three lines"
    assert text.index("## [Unreleased]") == text.index("## [")  # the first section
    releases = RELEASE.findall(text)
    assert releases, "CHANGELOG.md has no dated release (## [X.Y.Z] - YYYY-MM-DD)"
    versions = [Version(v) for v, _ in releases]
    dates = [datetime.date.fromisoformat(d) for _, d in releases]
    assert versions == sorted(versions, reverse=True) and dates == sorted(dates, reverse=True)
    newest = versions[0]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    version = Version(declared)
    assert version == newest or (version.is_devrelease and version > newest), (
        f"pyproject.toml's version {declared} is neither the newest release in CHANGELOG.md "
        f"({newest}) nor a development release after it (e.g. {newest.major}."
        f"{newest.minor}.{newest.micro + 1}.dev0)"
    )
    assert jstrategy.__version__ == declared
