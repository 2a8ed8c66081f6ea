"""Sphinx configuration of jstrategy's API reference (``make docs``).

The reference pages are generated at build time from the public namespaces' ``__all__``
(`public_modules`), so a name added to a namespace appears without editing any page.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout's jstrategy, not an installed copy

project = "jstrategy"
author = "the jstrategy authors"
copyright = "the jstrategy authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes sections as fields of the class, not a second description of each attribute.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
# Docstrings write `name` for code, as Markdown does; show it as code, linked when found.
default_role = "py:obj"
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "jstrategy API reference"
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
]
GENERATED = HERE / "reference"


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
    return f".. autodata:: {full}\n   :annotation: = {value!r}\n"


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


PAGES = write_pages()
(GENERATED / "index.rst").write_text(
    "Namespaces\n==========\n\n.. toctree::\n   :maxdepth: 1\n\n"
    + "".join(f"   {page}\n" for page in PAGES),
    encoding="utf-8",
)
