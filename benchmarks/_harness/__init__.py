"""The benchmarks' harness (imported from the scripts' own folder): the machine banner, the
command line, the geometry, the timed loop and its statistic, and the verdict. Every script
measures one scenario with these; none writes its own timed loop, statistic or verdict.

``environment``, ``flags``, ``geometry``, ``timing`` and ``verdict`` need only NumPy and
kvcache_core; ``torch_decode`` (transformers' caches side by side with ours) and
``generation`` (``model.generate`` side by side) need torch and transformers and are
imported by name.
"""

from __future__ import annotations

from .environment import RECOMMENDED_ENV, print_dispatch, print_environment
from .flags import BenchParser, geometry_of, int_list, layout_list, positive_int, seed_list
from .geometry import Geometry, StepInputs, draw_lengths, grow_staggered, mib, paged_decode_step
from .timing import (
    STATISTICS,
    PairedRatio,
    Stopwatch,
    Timings,
    cold_turns,
    paired_ratio,
    relative_spread,
    take_turns,
    timed_call,
)
from .verdict import ATOL, RTOL, DisagreementError, agree, agreement_check, met, ratio, require, run, within

__all__ = [
    "ATOL",
    "RECOMMENDED_ENV",
    "RTOL",
    "STATISTICS",
    "BenchParser",
    "DisagreementError",
    "Geometry",
    "PairedRatio",
    "StepInputs",
    "Stopwatch",
    "Timings",
    "agree",
    "agreement_check",
    "cold_turns",
    "draw_lengths",
    "geometry_of",
    "grow_staggered",
    "int_list",
    "layout_list",
    "met",
    "mib",
    "paged_decode_step",
    "paired_ratio",
    "positive_int",
    "print_dispatch",
    "print_environment",
    "ratio",
    "relative_spread",
    "require",
    "run",
    "seed_list",
    "take_turns",
    "timed_call",
    "within",
]
