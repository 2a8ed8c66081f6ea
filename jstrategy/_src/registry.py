"""The one registry of saveable classes: what a saved ``class_name`` may name, by kind.

A class is saved by its registered name and its config (``get_config()``) and rebuilt
from them; a saved ``class_name`` is resolved only through this registry, never as an
attribute of a module, so loading imports and calls nothing a file names. Every kind
registers where its classes are defined, as Keras's ``object_registration`` does: layers,
regularizers and constraints (``layers/``), losses and metrics, optimizers and learning-rate
schedules, and models (`Model`, `Sequential`). The registry imports nothing of the library,
so every layer of it can register.

Example:

>>> class Scale:
...     def __init__(self, factor=2.0):
...         self.factor = factor
>>> register_saveable(Scale, kind="doctest-kind") is Scale
True
>>> saveable_class("doctest-kind", "Scale") is Scale, saveable_name(Scale(), "doctest-kind")
(True, 'Scale')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import overload

__all__ = [
    "register_kind",
    "register_saveable",
    "saveable_class",
    "saveable_classes",
    "saved_class",
    "saveable_name",
]

_T = TypeVar("_T", bound=type)

#: For each kind, its registered classes by saved name.
_REGISTRY: dict[str, dict[str, type]] = {}
#: What a class of a kind must derive from; a kind not listed takes any class.
_BASES: dict[str, type] = {}


def register_kind(kind: str, base: type) -> None:
    """Makes every class registered as `kind` a subclass of `base` (checked)."""
    _BASES[kind] = base


@overload
def register_saveable(cls: _T, *, kind: str, name: str | None = None) -> _T: ...


@overload
def register_saveable(
    cls: None = None, *, kind: str, name: str | None = None
) -> Callable[[_T], _T]: ...


def register_saveable(cls: Any = None, *, kind: str, name: str | None = None) -> Any:
    """Registers `cls` as saved by name and ``get_config()``.

    Use it as a function or as a decorator (``@register_saveable(kind="layer")``).

    Args:
      cls: the class; its ``get_config()`` returns JSON types that rebuild it.
      kind: what it is: ``"layer"``, ``"regularizer"``, ``"constraint"``, ``"loss"``
        (a `jstrategy.losses.Loss`), ``"metric"`` (a `jstrategy.metrics.Metric`),
        ``"optimizer"``, ``"schedule"``, ``"model"`` or another module's kind.
      name: the name saved; defaults to ``cls.__name__``.

    Returns:
      `cls` (or, without `cls`, a decorator that registers its class).

    Raises:
      TypeError: if `cls` is not a class of the kind.
      ValueError: if another class is registered under the name.
    """

    def register(cls: _T) -> _T:
        base = _BASES.get(kind)
        if not isinstance(cls, type) or (base is not None and not issubclass(cls, base)):
            expected = "a class" if base is None else f"a subclass of {base.__qualname__}"
            raise TypeError(f"`cls` must be {expected} to register as a {kind!r}; got {cls!r}.")
        key = cls.__name__ if name is None else name
        classes = _REGISTRY.setdefault(kind, {})
        other = classes.get(key)
        if other is not None and other is not cls:
            raise ValueError(
                f"{kind.capitalize()} name {key!r} is already registered for "
                f"{other.__module__}.{other.__qualname__}; register "
                f"{cls.__module__}.{cls.__qualname__} with another name=."
            )
        classes[key] = cls
        return cls

    return register if cls is None else register(cls)


def saveable_class(kind: str, name: str) -> type | None:
    """The class registered under `name` for `kind`, or None."""
    return _REGISTRY.get(kind, {}).get(name)


def saveable_name(obj: Any, kind: str) -> str | None:
    """The name `obj`'s class (exactly, not a subclass) is registered under, or None."""
    for key, cls in _REGISTRY.get(kind, {}).items():
        if type(obj) is cls:
            return key
    return None


def saveable_classes(kind: str) -> dict[str, type]:
    """Every class registered for `kind`, by saved name (a copy)."""
    return dict(_REGISTRY.get(kind, {}))


def saved_class(kind: str, name: Any, unknown: Callable[[list[str]], str]) -> type:
    """The class of `kind` a saved ``class_name`` names.

    Raises:
      ValueError: ``unknown(known names)`` if `name` names none.
    """
    cls = saveable_class(kind, name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(unknown(sorted(saveable_classes(kind))))
    return cls
