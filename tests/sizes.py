"""How big the slowest tests run: examples of a property test, steps of a state machine,
operations of a soak.

``KVCACHE_TEST_SIZE=full`` (set by ``.ci/run``) runs them at full size; unset, or
``everyday`` (the README's command), at a size that keeps the suite within minutes on a
2-core machine. Either way every test runs, with the same strategies and rules: only how
many examples, steps or operations it draws changes.

A support module, not a test file: it holds no tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: The environment variable that chooses the size.
SIZE_ENV = "KVCACHE_TEST_SIZE"

#: The sizes, everyday first (the default).
SIZES = ("everyday", "full")


def chosen_size(environ: Mapping[str, str] = os.environ) -> str:
    """The size ``environ`` chooses: ``KVCACHE_TEST_SIZE``, ``everyday`` where unset or empty.

    Raises:
        ValueError: the variable names no size of :data:`SIZES`.
    """
    value = environ.get(SIZE_ENV, "") or SIZES[0]
    if value not in SIZES:
        raise ValueError(f"{SIZE_ENV} must be one of {', '.join(SIZES)} (or unset), got {value!r}")
    return value


#: Whether this run is at full size.
FULL = chosen_size() == "full"


def sized(full: int, everyday: int) -> int:
    """``full`` in a full-size run, else ``everyday``."""
    return full if FULL else everyday
