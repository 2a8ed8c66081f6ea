"""The compiler's refusal of a program for memory, read from its error.

The TPU compiler checks a program against the chip's memory as it compiles, on a TPU and
on a topology's compile-only devices alike, and refuses one that cannot fit with a
``RESOURCE_EXHAUSTED`` runtime error, e.g. ``CompileTimeHbmOom: ... the total memory
required for HLO temporaries (16.38G) exceeds available HBM (15.75G)``. `plan` reports
such a program as not fitting, with the compiler's figures (`CompilerRefusal`), never as
the raw error.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["CompilerRefusal", "compiler_refusal"]

# XLA prints sizes as tsl's HumanReadableNumBytes does: powers of 1024 ("16.38G" is GiB).
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = r"([\d.]+)\s*([KMGTP]?)(?:i?B)?"
# The compile-time check: "... required for HLO temporaries (16.38G) exceeds available
# HBM (15.75G)"; and the older allocator's "Used 20.50G of 15.75G hbm".
_EXCEEDS = re.compile(rf"\({_SIZE}\)\s*exceeds available [\w ]*?\({_SIZE}\)")
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} (\w+)")
_MARKERS = ("CompileTimeHbmOom", "exceeds available", "Ran out of memory")


@dataclasses.dataclass(frozen=True)
class CompilerRefusal:
    """The compiler refused the train step for memory (`MemoryPlan.compiler_refusal`).

    Attributes:
      required: the bytes per device the compiler said the program needs (None where
        its message gives no figure).
      available: the bytes per device it said there are (None likewise).
      message: the compiler's message, first line.

    Example:

    >>> r = compiler_refusal("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of "
    ...     "memory on HBM, the total memory required for HLO temporaries (3.00G) exceeds "
    ...     "available HBM (2.00G).")
    >>> r.required == 3 * 2**30, r.available == 2 * 2**30
    (True, True)
    """

    required: int | None
    available: int | None
    message: str


def compiler_refusal(error: BaseException | str) -> CompilerRefusal | None:
    """The compiler's refusal of a program for memory, from the error it raised (or its
    text); None for any other error.

    Args:
      error: what compiling raised (a ``jax.errors.JaxRuntimeError``), or its message.

    Returns:
      A `CompilerRefusal` with the figures its message gives (bytes, as XLA's ``G`` means
      GiB), or None when the error is not a refusal for memory.

    Example:

    >>> compiler_refusal(ValueError("shapes do not match")) is None
    True
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or not any(m in text for m in _MARKERS):
        return None
    lines = text.strip().splitlines()
    message = lines[0] if lines else ""
    found = _EXCEEDS.search(text)
    if found is None:
        found = _USED.search(text)
    if found is None:
        return CompilerRefusal(None, None, message)
    required = _bytes(found.group(1), found.group(2))
    available = _bytes(found.group(3), found.group(4))
    return CompilerRefusal(required, available, message)


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])
