"""What users read runs: README.md and every guide, each page in its own namespace.

A page's ```python blocks run in order in one namespace (as mktestdocs' memory mode), so a
reader who pastes them into one interpreter, top to bottom, gets no NameError; each page
starts afresh, in a temporary working directory (what it writes lands there). A ```text
block right after a ```python block is what that block prints: the test compares it, the
numbers within one unit of their last printed digit (integers exactly) and ``...`` standing
for any text. Blocks fenced otherwise are shown, not run: ```bash, and ```python no-run for
the few programs that need a cluster of several machines. Under conftest.py's 8 fake CPU
devices.
"""

from __future__ import annotations

import contextlib
import io
import math
import pathlib
import re
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ROOT / "docs" / "guides"
# What users read, in the order the site lists it; docs/index.md only includes the README.
PAGES = [README, *sorted(GUIDES.glob("*.md")), ROOT / "docs" / "benchmarks.md"]
# Each guide the issue asked for (issue 36, item 2), by file name.
EXPECTED_GUIDES = {
    "index",
    "getting-started",
    "coming-from-tf-distribute",
    "coming-from-keras",
    "keras-3-models",
    "flax-linen-and-nnx",
    "distributed-input",
    "multiple-processes",
    "large-models",
    "pipeline-parallelism",
    "mixed-precision-and-accumulation",
    "checkpoints",
    "tpus-and-colab",
    "troubleshooting",
}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
SHOWN = {"python no-run", "bash", "text"}
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


class Block(NamedTuple):
    info: str  # the fence's info string: python, bash, text, python no-run
    line: int  # the line of its first line of code, in the page
    code: str
    start: int  # where the fence starts and ends, in the page's text
    end: int


def blocks(text: str) -> list[Block]:
    """Every fenced block of a page, in order."""
    return [
        Block(m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2), *m.span())
        for m in FENCE.finditer(text)
    ]


def programs(text: str) -> list[tuple[Block, str | None]]:
    """Each ```python block with the ```text block that shows its output, if one follows."""
    found = blocks(text)
    runs = []
    for i, block in enumerate(found):
        if block.info != "python":
            continue
        after = found[i + 1] if i + 1 < len(found) else None
        shown = after is not None and after.info == "text"
        expected = after.code if shown and not text[block.end : after.start].strip() else None
        runs.append((block, expected))
    return runs


def test_the_block_reader_finds_blocks_lines_and_outputs():
    text = (
        "a\n```python\nprint(1)\n```\n\n```text\n1\n```\nb\n```bash\nmake\n```\n"
        "```python no-run\ny\n```\n```python\nz = 2\n```\nprose\n```text\nnot its output\n```\n"
    )
    assert [(b.info, b.line, b.code) for b in blocks(text)] == [
        ("python", 3, "print(1)\n"),
        ("text", 7, "1\n"),
        ("bash", 11, "make\n"),
        ("python no-run", 14, "y\n"),
        ("python", 17, "z = 2\n"),
        ("text", 21, "not its output\n"),
    ]
    # A text block is a block's output only right after it (blank lines between at most).
    assert [(b.line, out) for b, out in programs(text)] == [(3, "1\n"), (17, None)]


def matches(actual: str, expected: str) -> bool:
    """Whether printed output is what the page shows.

    Text must be equal (trailing spaces and blank lines aside), ``...`` matches any text,
    and each number may differ by one unit of its last printed digit or 0.1%; an integer
    must be equal.
    """

    def lines(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())

    pattern, numbers = "", []
    for piece in re.split(r"(\.\.\.)", lines(expected)):
        if piece == "...":
            pattern += ".*?"
            continue
        position = 0
        for number in NUMBER.finditer(piece):
            pattern += re.escape(piece[position : number.start()]) + f"({NUMBER.pattern})"
            numbers.append(number.group())
            position = number.end()
        pattern += re.escape(piece[position:])
    found = re.fullmatch(pattern, lines(actual), re.S)
    if found is None:
        return False
    for want, got in zip(numbers, found.groups(), strict=True):
        if re.fullmatch(r"[-+]?\d+", want):
            if int(want) != float(got):
                return False
            continue
        decimals = len(want.split(".")[1].split("e")[0].split("E")[0]) if "." in want else 0
        unit = 10.0**-decimals * (
            10.0 ** int(re.split("[eE]", want)[1]) if "e" in want.lower() else 1
        )
        if not math.isclose(float(want), float(got), rel_tol=1e-3, abs_tol=unit * 1.01):
            return False
    return True


def test_output_comparison_tolerates_the_last_digit_and_ellipses():
    assert matches("loss 0.1234\n", "loss 0.123")
    assert matches("loss 0.124", "loss 0.123")  # one unit of the last digit
    assert not matches("loss 0.126", "loss 0.123")
    assert not matches("193 params", "194 params")  # integers are exact
    assert matches("shape (8, 32, 32) P('stage', None, None)", "shape (8, 32, 32) P('stage', ...)")
    assert not matches("other text 1", "text 1")
    assert matches("a 1.0e-05\n\n", "a 1e-05")
    assert not matches("a 3e-05", "a 1e-05")


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and MyST's ``myst_heading_anchors``) gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    outside_blocks = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", outside_blocks, re.M)}


def links(page: pathlib.Path) -> list[str]:
    """The targets of the page's Markdown links, outside code blocks."""
    outside_blocks = FENCE.sub("", page.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)\)", outside_blocks)


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_guides_are_there_and_listed():
    assert {p.stem for p in GUIDES.glob("*.md")} == EXPECTED_GUIDES
    listed = {pathlib.Path(target.split("#")[0]).stem for target in links(GUIDES / "index.md")}
    assert EXPECTED_GUIDES - {"index"} <= listed
    # The README's "where next" links every guide.
    from_readme = {pathlib.Path(t.split("#")[0]).stem for t in links(README) if "guides/" in t}
    assert EXPECTED_GUIDES - {"index"} <= from_readme
    assert github_anchor("Custom loop with `strategy.run`, as in tf.distribute") == (
        "custom-loop-with-strategyrun-as-in-tfdistribute"
    )


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_fence_says_what_it_holds(page):
    """A bare ``` fence would be neither run nor highlighted: name what it holds."""
    infos = [(block.line, block.info) for block in blocks(page.read_text(encoding="utf-8"))]
    assert not [(line, info) for line, info in infos if info not in SHOWN | {"python"}]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_link_resolves(page):
    """Links to other pages name files that exist, and headings that exist there."""
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        missing = not file.exists() or ROOT not in file.parents
        if missing or (anchor and (file.suffix != ".md" or anchor not in anchors(file))):
            broken.append(target)
    assert not broken, f"{page_id(page)}: links to nothing: {broken}"


def test_the_readme_is_short_and_keeps_the_quick_start():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 20_000
    assert "make demo" in text and "make test" in text
    assert "## Differences from Keras 3" in text


def _reset_global_state(namespace: dict) -> None:
    """What a page may leave set for the next: precision, numerics checks, coordinators."""
    import jstrategy
    from jstrategy import mixed_precision
    from jstrategy.coordinator import ClusterCoordinator

    mixed_precision.set_global_policy("float32")
    jstrategy.config.disable_check_numerics()
    jstrategy.config.experimental_check_mirrored(False)
    for value in namespace.values():
        if isinstance(value, ClusterCoordinator):
            value.shutdown()
        elif isinstance(value, jstrategy.CheckpointManager):
            value.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in PAGES if programs(p.read_text(encoding="utf-8"))], ids=page_id
)
def test_page_runs_and_prints_what_it_shows(page, monkeypatch, tmp_path):
    # The TPU guide says to run TPUStrategy this way without a TPU (the notebooks do too).
    monkeypatch.setenv("JSTRATEGY_ALLOW_NON_TPU", "1")
    monkeypatch.chdir(tmp_path)  # checkpoints and logs the page writes
    namespace: dict = {"__name__": "__main__"}
    try:
        for block, expected in programs(page.read_text(encoding="utf-8")):
            # Line numbers in tracebacks are the page's.
            where = f"{page_id(page)}:{block.line}"
            program = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(program, namespace)
            except Exception as error:
                pytest.fail(f"the block at {where} raised {error!r}")
            if expected is not None and not matches(printed.getvalue(), expected):
                pytest.fail(
                    f"the block at {where} printed\n{printed.getvalue()}\n"
                    f"where the page shows\n{expected}"
                )
    finally:
        _reset_global_state(namespace)
