"""The README runs: every ```python block of README.md, in order, in one namespace.

As mktestdocs' memory mode runs Markdown: a block sees the names the blocks above it
defined, so a reader who pastes them into one interpreter, top to bottom, gets no
NameError. Blocks fenced with anything else (```bash, or ```python no-run for what needs a
cluster of several machines) are shown, not run. Under conftest.py's 8 fake CPU devices.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, int, str]]:
    """Every fenced block as ``(info string, line of its first line of code, code)``."""
    return [
        (m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
    ]


def python_blocks(text: str) -> list[tuple[int, str]]:
    return [(line, code) for info, line, code in blocks(text) if info == "python"]


def test_the_block_reader_finds_blocks_and_their_lines():
    text = "a\n```python\nx = 1\n```\nb\n```bash\nmake\n```\n```python no-run\ny\n```\n"
    # The line numbers are those of each block's first line of code.
    assert blocks(text) == [
        ("python", 3, "x = 1\n"),
        ("bash", 7, "make\n"),
        ("python no-run", 10, "y\n"),
    ]
    assert python_blocks(text) == [(3, "x = 1\n")]


def test_every_fence_is_python_bash_or_text():
    """A bare ``` fence would be neither run nor highlighted: name what it holds."""
    infos = [(line, info) for info, line, _ in blocks(README.read_text(encoding="utf-8"))]
    known = {"python", "python no-run", "bash", "text"}
    assert not [(line, info) for line, info in infos if info not in known]
    assert sum(info == "python" for _, info in infos) >= 14


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_within_the_readme_names_a_heading():
    text = README.read_text(encoding="utf-8")
    outside_blocks = FENCE.sub("", text)
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", outside_blocks, re.M)}
    assert github_anchor("Custom loop with `strategy.run`, as in tf.distribute") == (
        "custom-loop-with-strategyrun-as-in-tfdistribute"
    )
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 20  # the table of contents
    assert not [link for link in links if link not in anchors]


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(monkeypatch, capsys):
    import jstrategy
    from jstrategy import mixed_precision

    # How the README says to try TPUStrategy without a TPU (the notebooks do the same).
    monkeypatch.setenv("JSTRATEGY_ALLOW_NON_TPU", "1")
    namespace: dict = {"__name__": "__readme__"}
    try:
        for line, code in python_blocks(README.read_text(encoding="utf-8")):
            # Line numbers in tracebacks are README.md's.
            program = compile("\n" * (line - 1) + code, f"{README}:{line}", "exec")
            try:
                exec(program, namespace)
            except Exception as error:
                pytest.fail(f"README.md's block at line {line} raised {error!r}")
    finally:
        mixed_precision.set_global_policy("float32")
        jstrategy.config.disable_check_numerics()
        coordinator = namespace.get("coordinator")
        if coordinator is not None:
            coordinator.shutdown()
    out = capsys.readouterr().out
    # The seed program's summary, with Keras's totals.
    assert "Total params: 193 (772.00 B)" in out
    assert "Check numerics: the loss is NaN or infinite" in out
