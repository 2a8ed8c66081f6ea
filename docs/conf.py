"""Sphinx configuration of jstrategy's documentation site (``make docs``).

The site is the README (the landing page), the guides (``docs/guides/*.md``, MyST
Markdown), the benchmarks, the changelog and the API reference. The reference pages are
generated at build time from the public namespaces' ``__all__`` (`public_modules`), so a
name added to a namespace appears without editing any page.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import flax.linen as nn
from sphinx.pycode import ModuleAnalyzer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's jstrategy, not an installed copy

project = "jstrategy"
author = "the jstrategy authors"
copyright = "the jstrategy authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
# The guides are Markdown that GitHub renders too: links to headings are GitHub's anchors.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_heading_anchors = 4
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields of the class, not a second description of each attribute.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types only for the parameters a docstring describes: not Flax's ``parent`` and ``name``.
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
# Docstrings write `name` for code, as Markdown does; show it as code, linked when found.
default_role = "py:obj"
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "jstrategy"
templates_path: list[str] = []

# The namespaces the reference walks; each one's modules in ``__all__`` are walked too.
ROOTS = [
    "jstrategy",
    "jstrategy.experimental",
    "jstrategy.optimizers",
    "jstrategy.losses",
    "jstrategy.metrics",
    "jstrategy.callbacks",
    "jstrategy.mixed_precision",
    "jstrategy.models",
    "jstrategy.training",
    "jstrategy.coordinator",
    "jstrategy.cluster_resolver",
    "jstrategy.config",
    "jstrategy.tpu",
    "jstrategy.launch",
    "jstrategy.layers",
    "jstrategy.regularizers",
    "jstrategy.keras",
]
GENERATED = HERE / "api" / "reference"


def public_modules() -> list[types.ModuleType]:
    """Every public namespace: `ROOTS` that import, and the modules their ``__all__`` name."""
    seen: dict[str, types.ModuleType] = {}
    queue = list(ROOTS)
    while queue:
        name = queue.pop(0)
        if name in seen:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:
                continue
            raise
        seen[name] = module
        for attr in getattr(module, "__all__", ()):
            value = getattr(module, attr)
            if isinstance(value, types.ModuleType):
                queue.append(value.__name__)
    return sorted(seen.values(), key=lambda m: (m.__name__ != "jstrategy", m.__name__))


def public_names(module: types.ModuleType) -> list[str]:
    return list(getattr(module, "__all__", ()))


def _directive(module: types.ModuleType, attr: str, canonical: dict[int, str]) -> str:
    value = getattr(module, attr)
    full = f"{module.__name__}.{attr}"
    if isinstance(value, types.ModuleType):
        return (
            f".. py:data:: {attr}\n   :module: {module.__name__}\n   :no-index:\n\n"
            f"   The namespace :doc:`{value.__name__}`.\n"
        )
    first = canonical.setdefault(id(value), full)
    if first != full and (inspect.isclass(value) or inspect.isroutine(value)):
        return (
            f".. py:data:: {attr}\n   :module: {module.__name__}\n\n"
            f"   The same object as `{first}`.\n"
        )
    if inspect.isclass(value):
        return (
            f".. autoclass:: {full}\n   :members:\n   :show-inheritance:\n"
            "   :special-members: __call__\n"
        )
    if inspect.isroutine(value):
        return f".. autofunction:: {full}\n"
    doc = "\n".join(f"   {line}" if line else "" for line in constant_doc(module, attr))
    return (
        f".. py:data:: {attr}\n   :module: {module.__name__}\n"
        f"   :type: {type(value).__name__}\n   :value: {value!r}\n\n{doc}\n"
    )


def constant_doc(module: types.ModuleType, attr: str) -> list[str]:
    """The ``#:`` comment above a public constant where it is defined.

    A namespace re-exports the constant (``from jstrategy._src.x import NAME``), and autodoc
    would describe the value's type instead (``str``'s docstring): read the comment from
    the module that defines it. A public constant without one fails the build.
    """
    origin, original = module.__name__, attr
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == attr:
                    origin, original = node.module, alias.name
    lines = ModuleAnalyzer.for_module(origin).find_attr_docs().get(("", original))
    if not lines or not "".join(lines).strip():
        raise ValueError(
            f"{module.__name__}.{attr} is public but has no `#:` comment above its definition "
            f"in {origin}: write one (the reference shows it)"
        )
    return [line.rstrip() for line in lines]


def write_pages() -> list[str]:
    """Writes one page per public namespace; returns their names."""
    GENERATED.mkdir(exist_ok=True)
    for old in GENERATED.glob("*.rst"):
        old.unlink()
    canonical: dict[int, str] = {}
    pages = []
    for module in public_modules():
        name = module.__name__
        lines = [name, "=" * len(name), "", f".. automodule:: {name}", "   :no-members:", ""]
        names = public_names(module)
        if names:
            lines += [".. rubric:: Public names", ""]
            lines += [f"- `{name}.{attr}`" for attr in names] + [""]
        for attr in names:
            lines.append(_directive(module, attr, canonical))
        (GENERATED / f"{name}.rst").write_text("\n".join(lines), encoding="utf-8")
        pages.append(name)
    return pages


PAGES = write_pages()  # docs/api/index.rst lists them (a glob)


def _without_flax_internals(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None, ret: Any
) -> tuple[str | None, Any] | None:
    """Drops Flax's ``parent`` (a ``_Sentinel`` default) from a Flax module's signature.

    Every linen module's dataclass has it for Flax's own bookkeeping; a user never passes
    it. ``name`` stays: it names the layer, as a Keras layer's ``name=``.
    """
    if what == "class" and inspect.isclass(obj) and issubclass(obj, nn.Module) and signature:
        return re.sub(r",?\s*parent=<[^>]*>", "", signature), ret
    return None


def _skip_boilerplate(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> Any:
    """Leaves out the layers' ``validate`` (the constructor's checks, called by Flax) and a
    ``__call__`` with no docstring of its own (Python's "Call self as a function.")."""
    owner = getattr(obj, "__qualname__", "").rpartition(".")[0]
    if (
        name == "validate"
        and owner
        and any(
            inspect.isclass(c) and issubclass(c, nn.Module) and c.__qualname__ == owner
            for c in vars(inspect.getmodule(obj)).values()
        )
    ):
        return True
    if name == "__call__":
        doc = inspect.getdoc(obj)
        if not doc or doc.startswith("Call self as a function"):
            return True
    return None


def _readme_is_the_index(app: Any, docname: str, source: list[str]) -> None:
    """A guide's link to the README (``../../README.md#...``, right on GitHub) goes to the
    site's index page, which includes the README."""
    if docname.startswith("guides/"):
        source[0] = source[0].replace("](../../README.md", "](../index.md")


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _readme_is_the_index)
    app.connect("autodoc-process-signature", _without_flax_internals)
    app.connect("autodoc-skip-member", _skip_boilerplate)
    return {"parallel_read_safe": True}
