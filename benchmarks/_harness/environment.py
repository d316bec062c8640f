"""The machine and the libraries a benchmark runs on: printed before every figure, since a
ratio means nothing without them.

This module imports nothing but the standard library, so a test can read
``RECOMMENDED_ENV`` without importing the benchmarks' other dependencies.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcache_core.backends.dispatch import machine_key

__all__ = [
    "LIBRARIES",
    "RECOMMENDED_ENV",
    "THREAD_VARIABLES",
    "cache_sizes",
    "cpu_model",
    "print_dispatch",
    "print_environment",
]

#: glibc keeps large buffers instead of returning them to the OS after every step, which
#: otherwise dominates the time of the caches that reallocate (dense, DynamicCache).
RECOMMENDED_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}

#: The distributions whose versions change the figures.
LIBRARIES = ("numpy", "torch", "jax", "jaxlib", "numba", "transformers")

#: The variables that size the thread pools of BLAS, OpenMP (torch) and numba: on a machine
#: other processes share, a thread waiting for a busy core can make a step several times slower.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")

_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_model() -> str:
    """The CPU's model name, as the attention dispatch keys its calibrations by it
    (``/proc/cpuinfo``; else what ``platform`` says)."""
    return machine_key({})["cpu"]


def cache_sizes() -> str:
    """The first core's caches, ``"L1d 48K, L1i 32K, L2 2048K, L3 307200K"`` (Linux sysfs;
    ``"unknown"`` elsewhere)."""
    sizes: list[str] = []
    try:
        for index in sorted(_CPU_CACHES.glob("index*")):
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            sizes.append(f"L{level}{suffix} {(index / 'size').read_text().strip()}")
    except OSError:
        return "unknown"
    return ", ".join(sizes) or "unknown"


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def library_versions() -> str:
    """``"Python 3.11.7, numpy 2.1.0, torch 2.5.1, jax absent, ..."`` (installed versions,
    read without importing the libraries)."""
    parts = [f"Python {platform.python_version()}"]
    for name in LIBRARIES:
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} absent")
    return ", ".join(parts)


def print_environment() -> None:
    """Print the machine (CPU model, cores, caches), the library versions, the thread
    variables and the recommended environment and whether this process has it."""
    print(
        f"machine: {cpu_model()}, {usable_cores()} usable cores of {os.cpu_count()}, caches {cache_sizes()}, "
        f"{sys.platform}"
    )
    print(f"libraries: {library_versions()}")
    threads = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in THREAD_VARIABLES)
    print(f"threads: {threads} (on a shared machine, 1 thread per pool is steadier)")
    missing = [key for key, value in RECOMMENDED_ENV.items() if os.environ.get(key) != value]
    recommended = " ".join(f"{key}={value}" for key, value in RECOMMENDED_ENV.items())
    print(f"recommended environment: {recommended} ({'set' if not missing else 'NOT set: ' + ', '.join(missing)})")


def print_dispatch(choices: Mapping[str, Any]) -> None:
    """Print the attention path each shape class ran in this process: ``choices`` is an
    ``AttentionDispatch``'s (``kvcache_torch.dispatch.DISPATCH.choices()``), class key -> its
    ``DispatchChoice`` (the path, each path's seconds as measured, whether it won decisively:
    then it is kept in the calibration file, unless ``KVCACHE_CACHE_DIR=off``).
    A ratio means as little without the path that produced it as without the machine."""
    if not choices:
        print("attention paths: none measured in this run (pinned, or no class seen)")
        return
    print(
        "attention paths in this run ('in-model' classes: per layer, timed inside the run; "
        "the others: per call, timed on the call in a loop):"
    )
    for key, choice in sorted(choices.items()):
        times = ", ".join(f"{name} {seconds * 1e6:.0f} us" for name, seconds in sorted(choice.seconds.items()))
        kept = "decisive: kept on disk" if choice.settled else "within the noise: held for this run"
        print(f"  {key}: {choice.path} ({times}; {kept})")
