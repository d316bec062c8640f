"""The verdict: ratios as printed, targets met or not, and exit status 1 when the compared
implementations disagree numerically (never on a time: shared machines are noisy)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ATOL", "RTOL", "DisagreementError", "agree", "agreement_check", "met", "ratio", "require", "run", "within"]

#: fp32 outputs of paged (per-run products, online softmax) and dense attention differ in the
#: last bits only: ``allclose(paged, dense, rtol=RTOL, atol=ATOL)``.
RTOL = 1e-4
ATOL = 1e-5


class DisagreementError(Exception):
    """Two implementations a benchmark compares computed different things."""


def ratio(numerator: float, denominator: float) -> str:
    """``numerator / denominator`` as printed in the tables: ``"1.27x"``."""
    return f"{numerator / denominator:.2f}x"


def met(condition: bool) -> str:
    """A target's verdict: ``"met"`` or ``"NOT met"``."""
    return "met" if condition else "NOT met"


def within(condition: bool) -> str:
    """A bound's verdict: ``"ok"`` or ``"OVER"``."""
    return "ok" if condition else "OVER"


def agree(ours: Sequence[Any], other: Sequence[Any], *, rtol: float = RTOL, atol: float = ATOL) -> tuple[bool, float]:
    """Whether every pair of arrays (NumPy, torch on the CPU, JAX) is ``allclose``, and the
    largest absolute difference."""
    pairs = [(np.asarray(mine), np.asarray(theirs)) for mine, theirs in zip(ours, other, strict=True)]
    worst = max(float(np.max(np.abs(mine - theirs))) for mine, theirs in pairs)
    return all(np.allclose(mine, theirs, rtol=rtol, atol=atol) for mine, theirs in pairs), worst


def require(condition: bool, message: str) -> None:
    """Raise ``DisagreementError(message)`` unless ``condition``.

    Raises:
        DisagreementError: ``condition`` is false.
    """
    if not condition:
        raise DisagreementError(message)


def run(main: Callable[[], int]) -> int:
    """``main()``'s status, or 1 (with the message on stderr) when it raised ``DisagreementError``."""
    try:
        return main()
    except DisagreementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def agreement_check(
    reference: str, others: Mapping[str, str], *, what: str, rtol: float = RTOL, atol: float = ATOL
) -> Callable[[Mapping[str, Any], int], None]:
    """A ``check`` for ``take_turns``: every round, the results of ``others`` (name -> label)
    must agree with ``reference``'s (per-layer arrays); the first round prints each
    comparison.

    Raises (the returned check):
        DisagreementError: a result differs from the reference's.
    """
    width = max(len(label) for label in others.values())

    def check(results: Mapping[str, Any], index: int) -> None:
        for name, label in others.items():
            same, worst = agree(results[reference], results[name], rtol=rtol, atol=atol)
            if index == 0:
                shown = "match" if same else "DIFFER"
                print(f"  verify {what}: {reference} vs {label:<{width}} {shown} (max |diff| {worst:.1e})")
            require(same, f"outputs differ at step {index} of {what}: {reference} vs {label} by {worst:.3e}")

    return check
