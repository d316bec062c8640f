"""The timed loop and its statistic: competitors take turns in one process, so whatever
drifts on the machine (other processes, frequency, caches) hits every one of them alike.

A round runs every competitor once, in an order that rotates by one each round; the first
``warmup`` rounds are untimed (a new shape pays for allocator growth and kernel set-up);
``check`` sees every round's results, outside the timed region, and raises
``DisagreementError`` when the competitors computed different things.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .verdict import met

__all__ = [
    "STATISTICS",
    "PairedRatio",
    "Stopwatch",
    "Timings",
    "cold_turns",
    "paired_ratio",
    "relative_spread",
    "take_turns",
    "timed_call",
]

Result = TypeVar("Result")

#: How a list of times becomes one figure: ``"median"`` (the default) or ``"min"`` (the
#: fastest sample: steadier where other processes share the machine, since they only add time).
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {"median": statistics.median, "min": min}


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over median (0 with fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4)
    return (high - low) / statistics.median(samples)


@dataclass(frozen=True)
class Timings:
    """Seconds per call of every competitor, one sample per timed round."""

    samples: dict[str, list[float]]
    statistic: str = "median"

    def seconds(self, name: str) -> float:
        """The statistic of ``name``'s samples, in seconds."""
        return STATISTICS[self.statistic](self.samples[name])

    def ms(self, name: str) -> float:
        """The statistic of ``name``'s samples, in milliseconds."""
        return self.seconds(name) * 1e3

    def us(self, name: str) -> float:
        """The statistic of ``name``'s samples, in microseconds."""
        return self.seconds(name) * 1e6

    def spread(self, *names: str) -> float:
        """The largest relative spread (IQR / median) of ``names`` (of every competitor if none)."""
        return max(relative_spread(self.samples[name]) for name in names or tuple(self.samples))


#: The least probability an interval of :func:`paired_ratio` holds the true median with,
#: where the rounds allow it (6 rounds or more).
COVERAGE = 0.95


@dataclass(frozen=True)
class PairedRatio:
    """Ratios of two competitors timed in the same rounds, one per round: their median and a
    distribution-free interval for it, ``[low, high]``, which holds the true median with
    probability ``coverage`` whatever the distribution of the ratios (order statistics).

    A round's two runs are close in time, so a drift of the machine's speed (other
    processes, frequency) cancels in their ratio, where it moves the ratio of two medians.
    """

    ratios: tuple[float, ...]
    low: float
    high: float
    coverage: float

    @property
    def median(self) -> float:
        """The median of the per-round ratios."""
        return float(statistics.median(self.ratios))

    def verdict(self, target: float, *, at_most: bool = False) -> str:
        """``"met"`` when the whole interval is at least ``target`` (``at_most``: at most),
        ``"NOT met"`` when it is wholly on the other side, else ``"undecided"`` (the rounds
        cannot tell it from noise)."""
        if at_most:
            reached, short = self.high <= target, self.low > target
        else:
            reached, short = self.low >= target, self.high < target
        return met(reached) if reached or short else "undecided (the interval spans it)"

    def __str__(self) -> str:
        return f"{self.median:.2f}x [{self.low:.2f}x, {self.high:.2f}x]"

    def interval(self) -> str:
        """How the interval was made, for a table's legend."""
        return f"median of {len(self.ratios)} paired runs [{self.coverage * 100:.1f} % interval]"


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> PairedRatio:
    """The per-round ratios ``numerators[i] / denominators[i]`` and the narrowest interval
    of their order statistics ``[r(k), r(n + 1 - k)]`` holding the median with probability
    at least :data:`COVERAGE` (``k`` from the binomial distribution of how many ratios fall
    below the median); with fewer than 6 rounds, ``[min, max]`` and its lower coverage.

    Raises:
        ValueError: no rounds, or lists of different lengths.
    """
    if not numerators or len(numerators) != len(denominators):
        raise ValueError(
            f"paired ratios need as many numerators as denominators, at least one: "
            f"{len(numerators)} and {len(denominators)}"
        )
    ratios = sorted(top / bottom for top, bottom in zip(numerators, denominators, strict=True))
    count = len(ratios)

    def coverage(k: int) -> float:  # P(k <= below <= count - k), below ~ Binomial(count, 1/2)
        tail = sum(math.comb(count, below) for below in range(k)) / (1 << count)
        return max(0.0, 1.0 - 2.0 * tail)

    k = 1
    while k + 1 <= (count + 1) // 2 and coverage(k + 1) >= COVERAGE:
        k += 1
    return PairedRatio(tuple(ratios), ratios[k - 1], ratios[count - k], coverage(k))


def timed_call(call: Callable[[], Result]) -> tuple[float, Result]:
    """Seconds one call takes, and what it returned."""
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


class Stopwatch:
    """Wall time since it was made (a script's ``total``, a build's time)."""

    def __init__(self) -> None:
        self._started = time.perf_counter()

    def seconds(self) -> float:
        """Seconds since the stopwatch was made."""
        return time.perf_counter() - self._started


def take_turns(
    *groups: Mapping[str, Callable[..., Result]],
    rounds: int,
    warmup: int = 0,
    calls: int = 1,
    inputs: Callable[[], object] | None = None,
    check: Callable[[Mapping[str, Result], int], None] | None = None,
    settle: Callable[[Result], object] | None = None,
    statistic: str = "median",
) -> Timings:
    """Run ``warmup + rounds`` rounds of every competitor of every group, group after group,
    each group in an order rotating by one a round (a later group reads what an earlier one
    wrote: floors after the caches).

    Args:
        groups: name -> competitor; names are unique across groups.
        rounds: timed rounds (one sample per competitor each).
        warmup: untimed rounds first (checked like the others).
        calls: calls per sample (a burst, for calls too short to time alone); a sample is
            their mean.
        inputs: when given, each round draws ``inputs()`` and hands them to every competitor
            (new K/V and queries of a decode step); else competitors take no argument.
        check: ``check(results, round)`` after every round, untimed; it raises
            ``DisagreementError`` when the results differ.
        settle: applied to a result inside the timed region (JAX: wait until it is ready).
        statistic: the figure ``Timings`` gives: ``"median"`` or ``"min"``.

    Returns:
        Every competitor's samples, seconds per call.
    """
    samples: dict[str, list[float]] = {name: [] for group in groups for name in group}
    for index in range(warmup + rounds):
        arguments = () if inputs is None else (inputs(),)
        results: dict[str, Result] = {}
        for group in groups:
            turns = list(group.items())
            shift = index % len(turns) if turns else 0
            for name, competitor in (*turns[shift:], *turns[:shift]):
                started = time.perf_counter()
                for _ in range(calls):
                    results[name] = competitor(*arguments)
                    if settle is not None:
                        settle(results[name])
                elapsed = (time.perf_counter() - started) / calls
                if index >= warmup:
                    samples[name].append(elapsed)
        if check is not None:
            check(results, index)
    return Timings(samples, statistic)


def cold_turns(
    competitors: Mapping[str, Callable[[], Sequence[Callable[[], object]]]],
    *,
    rounds: int,
    evict: Callable[[], object],
    warmup: int = 0,
    excluded: Callable[[], float] | None = None,
    statistic: str = "median",
    per_piece: bool = False,
) -> Timings:
    """Rounds of every competitor in a rotating order, as :func:`take_turns`, where a
    competitor is called untimed for its pieces (the calls of one sample: a decode step's
    planning and its layers) and each piece is timed alone after ``evict()``, untimed (what
    a model's own work between two calls does to the CPU's caches). A sample is the sum of
    its pieces' times, less what ``excluded()`` (a running total of seconds, such as the
    attention arithmetic's) grew by during each piece.

    Returns:
        Every competitor's samples, seconds per sample; with ``per_piece``, also each piece's
        own, named ``"<competitor>[<index>]"``.
    """
    samples: dict[str, list[float]] = {name: [] for name in competitors}
    turns = list(competitors.items())
    for index in range(warmup + rounds):
        shift = index % len(turns) if turns else 0
        for name, competitor in (*turns[shift:], *turns[:shift]):
            total = 0.0
            for number, piece in enumerate(competitor()):
                evict()
                before = 0.0 if excluded is None else excluded()
                started = time.perf_counter()
                piece()
                elapsed = time.perf_counter() - started
                spent = elapsed - (0.0 if excluded is None else excluded() - before)
                total += spent
                if per_piece and index >= warmup:
                    samples.setdefault(f"{name}[{number}]", []).append(spent)
            if index >= warmup:
                samples[name].append(total)
    return Timings(samples, statistic)
