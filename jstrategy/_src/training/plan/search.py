"""`plan`'s search for the largest global batch whose train step fits the devices.

One function of a step's compiled peak at a number of rows (`largest_batch`), so its
rules read, and are tested, apart from compiling: every size it tries is a multiple of
the strategy's ``batch_multiple`` (a batch the replicas cannot split does not compile),
and where the peak is not monotone in the batch it goes on past the fall, and says
that the answer is only a lower bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["LIMIT", "MAX_COMPILES", "PRECISION", "largest_batch"]

#: The most compiles the search makes after the batch given's and a second size's.
MAX_COMPILES = 8
#: The answer is wanted within 1/PRECISION of itself (or one ``batch_multiple``).
PRECISION = 32
#: The search looks no further than this many times the batch given.
LIMIT = 1024


def largest_batch(
    peak_at: Callable[[int], tuple[int, Any]],
    rows: int,
    peak: int,
    budget: int,
    multiple: int,
    fixed: int | None = None,
) -> tuple[int | None, str]:
    """The largest multiple of `multiple` whose step's peak fits `budget` (None when none
    does), and why it is only a lower bound: "" when it is within one step of the
    largest that fits (the step: a `multiple`, or 1/`PRECISION` of the answer, rounded
    down to a multiple).

    The peak is nearly affine in the batch, but neither exactly so nor always monotone:
    XLA's buffer assignment bends it where a temporary starts to grow with the rows, and
    a few more rows sometimes take fewer bytes (a Sequential of three Dense layers on two
    devices: 20,456,068 B at 7,168 rows, 19,894,788 B at 8,192). So:

    - a second size is compiled: where the line through ``(0, fixed)`` and the batch
      given reaches the budget, when `fixed` (the bytes that do not grow with the batch:
      the state's) is known (at 7B each compile takes a minute, and a second size far
      from the first makes the line through them, next, land within a few steps); else
      twice the batch given, or half when that does not fit;
    - while every size tried fits, the line through the two largest predicts the answer;
      where the peak fell between them, the size doubles instead;
    - while none fits, the line through the two smallest, else the least batch there is
      (one `multiple`: if it does not fit, none does);
    - between the largest size that fits and the smallest above it that does not, the
      line through those two narrows them (the Illinois method: the excess at an end
      left in place by two guesses in a row is halved, so a bent peak does not move one
      end by small steps) until they are one step apart;
    - then the first size where the answer would be more than a step short of the
      largest is compiled, past the one that did not fit, in case the peak falls back
      under the budget there; if it fits, the search goes on from it.

    Every size tried is a multiple of `multiple` and the size returned was compiled and
    fits. The reason is given when the peak fell as the batch grew between two sizes
    tried (a larger batch may fit past any of the sizes tried), or when the search ran
    out of compiles (`MAX_COMPILES`) before it narrowed the answer to one step.

    Args:
      peak_at: the step's peak at a number of rows (and what was compiled).
      rows: the batch given, a multiple of `multiple`.
      peak: the step's peak at `rows`.
      budget: the bytes the peak must fit in.
      multiple: what every batch divides by (``strategy.batch_multiple``).
      fixed: the bytes of the peak that do not grow with the batch, where known (the
        state and its gradients); only the second size tried depends on it.

    Example:

    >>> peak = lambda rows: 100_000 + 1_000 * rows  # bytes; a batch of 64: 164,000 B
    >>> largest_batch(lambda rows: (peak(rows), None), 64, peak(64), 3 * peak(64), 8)
    (392, '')
    """
    known = {rows: peak}
    if peak > budget and rows == multiple:
        return None, ""  # the smallest batch there is does not fit
    second = 2 * rows if peak <= budget else max(multiple, _down(rows // 2, multiple))
    if fixed is not None and peak > fixed:
        # The state's bytes stay, the rest grows with the rows: where that line crosses.
        second = _down(int(rows * (budget - fixed) / (peak - fixed)), multiple)
        if peak <= budget:
            second = min(max(second, rows + multiple), LIMIT * rows)
        else:
            second = min(max(second, multiple), rows - multiple)
    known[second] = peak_at(second)[0]
    limit = LIMIT * rows
    sides: list[bool] = []  # whether each narrowing guess fit, in order
    for _ in range(MAX_COMPILES):
        lo, hi, step = _bracket(known, budget, multiple)
        if hi is None:  # every size tried fits: the line through the two largest
            if lo >= limit:
                return lo, f"the search looks no further than {LIMIT}x the batch given"
            fit = sorted(b for b, p in known.items() if p <= budget)[-2:]
            guess = 2 * lo if len(fit) < 2 else _crossing(known, fit, budget, multiple, 2 * lo)
            guess = min(max(guess, lo + step), limit)
        elif hi - lo <= step:  # narrowed: then the first size where `lo` is a step short
            if lo == 0:
                break  # not even one multiple fits
            guess = _up(max(hi + 1, lo * PRECISION // (PRECISION - 1) + 1), multiple)
            if guess in known or guess > limit:
                break
        elif lo == 0:  # none fits: the line through the two smallest, else the least batch
            guess = _crossing(known, sorted(known)[:2], budget, multiple, multiple)
            guess = min(max(guess, multiple), hi - multiple)
        else:  # bracketed: the line through its ends, the end kept longest weighed less
            guess = _illinois(known, lo, hi, budget, sides, multiple)
            guess = min(max(guess, lo + step), hi - multiple)
        known[guess] = peak_at(guess)[0]
        if hi is not None and lo < guess < hi:
            sides.append(known[guess] <= budget)
    lo, hi, step = _bracket(known, budget, multiple)
    sizes = sorted(known)
    falls = [(a, b) for a, b in itertools.pairwise(sizes) if known[b] < known[a]]
    why = ""
    if falls:
        a, b = falls[-1]
        why = (
            f"the peak is not monotone in the batch: it fell from {known[a]:,} B at {a} rows "
            f"to {known[b]:,} B at {b}, so a larger batch may fit"
        )
    elif lo and (hi is None or hi - lo > step):
        why = (
            f"the search stopped after {len(known)} compiles, before it narrowed the answer "
            f"to 1/{PRECISION}"
        )
    return (lo or None), why


def _bracket(known: dict[int, int], budget: int, multiple: int) -> tuple[int, int | None, int]:
    """The largest size tried that fits (0 if none), the smallest above it (None if
    none), and the step the answer is wanted within: a multiple, or 1/32 of the answer."""
    lo = max((b for b, p in known.items() if p <= budget), default=0)
    hi = min((b for b in known if b > lo), default=None)
    return lo, hi, max(multiple, _down(lo // PRECISION, multiple))


def _down(n: int, multiple: int) -> int:
    return n // multiple * multiple


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _illinois(
    known: dict[int, int], lo: int, hi: int, budget: int, sides: list[bool], multiple: int
) -> int:
    """Where the line through ``(lo, hi)`` reaches `budget`, the excess at the end the last
    guesses all left in place halved for each guess after the first (the Illinois
    method: a bent peak otherwise moves one end by small steps)."""
    kept = 0  # how many guesses in a row fell on one side
    while kept < len(sides) and sides[-1 - kept] == sides[-1]:
        kept += 1
    under, over = budget - known[lo], known[hi] - budget
    if kept > 1 and sides[-1]:  # `hi` stayed
        over /= 2 ** (kept - 1)
    elif kept > 1:  # `lo` stayed
        under /= 2 ** (kept - 1)
    return _down(int(lo + (hi - lo) * under / (under + over)), multiple)


def _crossing(known: dict[int, int], pair: Any, budget: int, multiple: int, otherwise: int) -> int:
    """Where the line through the sizes `pair` reaches `budget` (rounded down to a
    multiple), or `otherwise` where that line does not rise."""
    b1, b2 = pair
    slope = (known[b2] - known[b1]) / (b2 - b1)
    if slope <= 0:
        return otherwise
    return _down(int(b1 + (budget - known[b1]) / slope), multiple)
