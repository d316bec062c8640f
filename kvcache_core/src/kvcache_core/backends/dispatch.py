"""Which attention path a backend runs for a shape of batch, chosen by measuring this machine.

A backend may have several ways to compute the same paged attention: the compiled kernel
of :mod:`kvcache_core.attention.kernel` (numba), and its array library's own path (in
torch, ``scaled_dot_product_attention`` on zero-copy views of each request's runs of
blocks). Which is faster depends on the machine (how much of a context its caches hold,
its vector units, its cores) as much as on the batch: on one 2-core Xeon the kernel won a
ragged decode batch 1.5x while the library's path won one long request by 1.3x. So no rule
is written here; the paths are timed on this machine.

* A **shape class** (:class:`ShapeClass`) is what decides the winner: decode, prefill or a
  mix; the requests in the batch and the longest context, in power-of-two buckets; whether
  a request is split over several runs of blocks; the pool's dtype, layout and geometry;
  the threads; the attention features. Two batches of one class run the same path.
* The first time a class is seen, :meth:`AttentionDispatch.run` **calibrates** it on the
  call itself: each path runs once untimed (first-call costs: compiling, warming caches),
  then each runs in turns (:data:`CALIBRATION_ROUNDS`, fewer for slow calls) and the
  faster wins, by its fastest run (the one least disturbed by the rest of the machine).
  The outputs are the call's (every path computes the same attention); the call returns
  the winner's. A win within the noise (:func:`_decisive`, as on a busy machine) holds for
  the process but is not kept on disk: the next process measures again. A calibration
  costs a few calls of the shape's attention: well under a second for a model's shapes.
* The choices are **cached on disk** per machine and library versions
  (:func:`machine_key`), in ``$KVCACHE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/kvcache``, else
  ``~/.cache/kvcache``), one JSON file per backend and machine key, named by a digest of
  the key (:func:`dispatch_file_name`), rewritten atomically (a temporary file created
  exclusively, then renamed). A later process on the same machine and versions reads its
  file and measures nothing. Machines sharing the directory (a home directory on a network
  file system) each keep their own file, and a new version of a library measures anew
  beside the old one's file, without a warning: neither replaces the other's choices. A file
  of this name that is corrupt, too large, or holds another machine's key (altered, or a
  digest collision) is ignored with a warning (and replaced at the next calibration).
  ``KVCACHE_CACHE_DIR=off`` keeps the choices in memory only; ``kvcache dispatch --forget``
  removes every file.
* A decode step inside a model is **measured as the model runs it** (``ShapeClass.measured``
  ``"model"``; a class of its own, listed ``in-model ...``). Between two layers' attention
  the model's projections stream their weights through the CPU's caches, and each layer
  reads K/V of its own: a call timed in a loop reads its K/V warm. On one 2-core EPYC (L3
  32 MiB) a layer of one 2048-token request took 59 us in the loop and 100 us inside
  ``generate``; where a CPU's cache holds one layer's K/V but not a model's, the two ways can
  rank the paths differently. The caller (a storage's step lane) asks
  :meth:`AttentionDispatch.trial_path` which path the step runs: the paths take turns,
  step by step, :data:`TRIAL_STEPS` steps each, the caller timing each layer's attention
  (:meth:`AttentionDispatch.record`); then the path of the lower median per layer wins.
  Nothing is computed twice: a trial step's output is its path's. A win by less than 5%
  holds for the process only, as a calibration's within the noise does.
* A path can be **pinned**: ``CacheConfig.attention_path`` (per pool), else the
  environment variable ``KVCACHE_ATTENTION_PATH`` (per process), ``"kernel"`` or
  ``"native"``; ``"auto"`` (the default) is the measured choice.

:meth:`AttentionDispatch.choices` lists the classes seen and the path each runs;
``kvcache dispatch`` prints them.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar, cast

from kvcache_core.attention.kernel import DISABLE_ENV, KERNEL_DTYPES, QUANTIZED_KERNEL_DTYPES, kernel_available
from kvcache_core.backends.dispatch_files import (
    CACHE_DIR_ENV,
    FILE_FORMAT,
    FILE_VERSION,
    MAX_FILE_BYTES,
    DispatchChoice,
    cache_directory,
    check_backend_name,
    dispatch_file_backend,
    dispatch_file_name,
    machine_key,
    read_dispatch_file,
)
from kvcache_core.contract.config import ATTENTION_PATHS, CacheConfig
from kvcache_core.errors import CacheFileError, InvalidConfigError, UnsupportedConfigError
from kvcache_core.offload.safe_files import remove_file, write_file_atomically

__all__ = [
    "ATTENTION_PATHS",
    "CACHE_DIR_ENV",
    "CALIBRATION_ROUNDS",
    "MAX_FILE_BYTES",
    "PATH_ENV",
    "TRIAL_STEPS",
    "AttentionDispatch",
    "DispatchChoice",
    "ShapeClass",
    "cache_directory",
    "check_attention_path",
    "check_backend_name",
    "dispatch_file_backend",
    "dispatch_file_name",
    "kernel_or_reference",
    "machine_key",
    "pinned_path",
    "read_dispatch_file",
]

T = TypeVar("T")

#: The environment variable that pins a path for every pool of the process whose config says "auto".
PATH_ENV: Final = "KVCACHE_ATTENTION_PATH"
#: Timed calls of each path when a class is calibrated (after one untimed call each).
CALIBRATION_ROUNDS: Final = 5
#: Steps each path runs when a class is measured as the model runs it (:meth:`AttentionDispatch.trial_path`).
TRIAL_STEPS: Final = 2
#: How much lower the winner's median per layer must be for a trial's choice to be kept on disk.
_TRIAL_MARGIN = 1.05
#: A call slower than this (seconds, in the first timed round, once warm) is timed once only.
_SLOW_CALL = 0.05


def check_attention_path(value: object, what: str = "CacheConfig.attention_path") -> str:
    """``value`` if it is one of :data:`ATTENTION_PATHS`.

    Raises:
        InvalidConfigError: anything else, named with the valid values.
    """
    if not isinstance(value, str) or value not in ATTENTION_PATHS:
        raise InvalidConfigError(f"{what} {value!r} is unknown; valid: {', '.join(ATTENTION_PATHS)}")
    return value


def pinned_path(configured: str) -> str:
    """The path a pool runs: its config's unless ``"auto"``, else ``KVCACHE_ATTENTION_PATH``'s
    (unset or empty: ``"auto"``). A path pinned in a config is refused by the backend where
    it cannot run; pinned by the environment (for every pool of the process), ``"kernel"``
    runs where the kernel can and the native path elsewhere.

    Raises:
        InvalidConfigError: ``KVCACHE_ATTENTION_PATH`` holds another value.
    """
    if configured != "auto":
        return configured
    return check_attention_path(os.environ.get(PATH_ENV, "") or "auto", PATH_ENV)


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """The features of a batch that decide which attention path is faster (see the module
    docstring); :attr:`key` is its text form in the calibration file."""

    phase: str
    requests: int
    context: int
    runs: str
    dtype: str
    layout: str
    kv_heads: int
    group: int
    head_dim: int
    value_dim: int
    threads: int
    features: str
    #: How the class is measured: ``"call"``, on the call itself in a loop (the calibration of
    #: :meth:`AttentionDispatch.run`); ``"model"``, step by step as a model runs it
    #: (:meth:`AttentionDispatch.trial_path`). Two classes differing only here are two classes.
    measured: str = "call"

    def __post_init__(self) -> None:
        if self.measured not in ("call", "model"):
            raise InvalidConfigError(f"ShapeClass.measured {self.measured!r} is unknown; valid: 'call', 'model'")

    @property
    def key(self) -> str:
        return (
            ("in-model " if self.measured == "model" else "")
            + f"{self.phase} requests<={self.requests} context<={self.context} runs={self.runs} {self.dtype} "
            f"{self.layout} heads={self.kv_heads}x{self.group} dims={self.head_dim}/{self.value_dim} "
            f"threads={self.threads} features={self.features}"
        )

    @staticmethod
    def of(
        query_counts: list[int],
        seq_lens: list[int],
        many_runs: bool,
        *,
        dtype: str,
        layout: str,
        kv_heads: int,
        group: int,
        head_dim: int,
        value_dim: int,
        threads: int,
        features: str,
    ) -> ShapeClass:
        """The class of a batch of ``query_counts[b]`` queries over ``seq_lens[b]`` tokens per request."""
        if all(count <= 1 for count in query_counts):
            phase = "decode"
        elif all(count in (0, length) for count, length in zip(query_counts, seq_lens, strict=True)):
            phase = "prefill"
        else:
            phase = "mixed"
        return ShapeClass(
            phase,
            _bucket(sum(1 for count in query_counts if count)),
            _bucket(max(seq_lens, default=1), floor=256),
            "many" if many_runs else "one",
            dtype,
            layout,
            kv_heads,
            group,
            head_dim,
            value_dim,
            threads,
            features,
        )


def _bucket(value: int, floor: int = 1) -> int:
    """The power of two at or above ``value`` (at least ``floor``)."""
    bucket = floor
    while bucket < value:
        bucket *= 2
    return bucket


class AttentionDispatch:
    """The measured choices of one backend on this machine (thread-safe); one per backend
    per process, shared by its pools.

    Args:
        backend: the backend's name (in the calibration file's name: :func:`check_backend_name`).
        libraries: name -> version of what the timings depend on, besides the machine.
        directory: where the file lives; by default :func:`cache_directory` at first use.

    Raises:
        InvalidTypeError, InvalidArgumentError: a ``backend`` name that may not stand in a file name.
    """

    def __init__(self, backend: str, libraries: Mapping[str, str], directory: Path | str | None = "default") -> None:
        self._backend = check_backend_name(backend)
        self._libraries = dict(libraries)
        self._directory = directory
        self._lock = threading.Lock()
        self._choices: dict[str, DispatchChoice] | None = None
        # Per class measured as the model runs it: per path, the steps it ran and the seconds
        # of each layer's attention recorded (the first, its warm-up, left out).
        self._trials: dict[str, dict[str, tuple[int, list[float] | None]]] = {}

    @property
    def libraries(self) -> dict[str, str]:
        """Name -> version of what the choices depend on besides the machine (a copy): a
        file written under other versions is ignored."""
        return dict(self._libraries)

    def _machine(self) -> dict[str, str]:
        """This machine's key (:func:`machine_key`) now (its usable cores may change)."""
        return machine_key(self._libraries)

    def _path(self) -> Path | None:
        directory = cache_directory() if self._directory == "default" else self._directory
        if directory is None:
            return None
        return Path(directory) / dispatch_file_name(self._backend, self._machine())

    def _load(self) -> dict[str, DispatchChoice]:
        """The choices of the file, or none (a warning says why a file is ignored)."""
        path = self._path()
        if path is None or not path.exists():
            return {}
        try:
            machine, choices = read_dispatch_file(path)
            here = self._machine()
            if machine != here:
                raise ValueError(f"it was measured on {machine!r}, this is {here!r}")
            return choices
        except (CacheFileError, ValueError) as exc:
            warnings.warn(f"ignoring the attention dispatch file {str(path)!r}: {exc}", RuntimeWarning, stacklevel=4)
            return {}

    def _save(self, choices: Mapping[str, DispatchChoice]) -> None:
        path = self._path()
        if path is None:
            return
        body = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "machine": self._machine(),
            "choices": {
                key: {"path": choice.path, "seconds": dict(choice.seconds)} for key, choice in sorted(choices.items())
            },
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomically(str(path), json.dumps(body, indent=1).encode(), what="the attention dispatch file")
        except (CacheFileError, OSError) as exc:  # measuring again next time is the only cost
            warnings.warn(f"cannot keep the attention dispatch choices: {exc}", RuntimeWarning, stacklevel=4)

    def _known(self) -> dict[str, DispatchChoice]:
        choices = self._choices
        if choices is None:
            with self._lock:
                if self._choices is None:
                    self._choices = self._load()
                choices = self._choices
        return choices

    def choice(self, shape: ShapeClass) -> DispatchChoice | None:
        """The recorded choice of ``shape``'s class, or ``None`` before it is calibrated."""
        return self._known().get(shape.key)

    def choices(self) -> dict[str, DispatchChoice]:
        """Every class calibrated on this machine (in this process or read from the file)."""
        return dict(self._known())

    def run(self, shape: ShapeClass, paths: Mapping[str, Callable[[], T]]) -> T:
        """The output of the path ``shape``'s class runs: the recorded one, or, the first
        time, the winner of a calibration of ``paths`` (name -> the call). A recorded path
        that is not among ``paths`` (not available here now) is calibrated again."""
        recorded = self.choice(shape)
        if recorded is not None and recorded.path in paths:
            return paths[recorded.path]()
        if len(paths) == 1:
            (only,) = paths.values()
            return only()
        outputs = {name: call() for name, call in paths.items()}  # untimed: compiling, first touches
        times: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for turn in range(CALIBRATION_ROUNDS):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:  # order rotates
                start = time.perf_counter()
                outputs[name] = paths[name]()
                times[name].append(time.perf_counter() - start)
            if turn == 0 and max(values[0] for values in times.values()) > _SLOW_CALL:
                break  # slow calls (judged once warm, not by the compiling first call): one round
        seconds = {name: min(values) for name, values in times.items()}  # the least disturbed run
        winner = min(seconds, key=lambda name: seconds[name])
        settled = all(_decisive(times[winner], values) for name, values in times.items() if name != winner)
        with self._lock:
            known = dict(self._choices or {})
            known[shape.key] = DispatchChoice(winner, seconds, settled)
            self._choices = known
            if settled:
                self._save({key: choice for key, choice in known.items() if choice.settled})
        return outputs[winner]

    def trial_path(self, shape: ShapeClass, paths: Sequence[str]) -> str:
        """The path the next step of ``shape``'s class runs, measured as the model runs it
        (see the module docstring): the recorded choice where there is one among ``paths``;
        else, while it is measured, the path of ``paths`` that ran the fewest steps (they take
        turns, in the order given); once each ran :data:`TRIAL_STEPS` steps and has a time
        recorded (:meth:`record`), the path of the lowest median, recorded as the choice (and
        kept on disk where it won by at least 5%).

        Raises:
            InvalidConfigError: ``paths`` empty, repeated, or naming a path that is not one of
                :data:`ATTENTION_PATHS` but ``"auto"``.
        """
        offered = tuple(paths)
        if not offered or len(set(offered)) != len(offered) or not set(offered) <= set(ATTENTION_PATHS[1:]):
            raise InvalidConfigError(f"trial paths {offered!r}: give distinct paths among {ATTENTION_PATHS[1:]}")
        recorded = self.choice(shape)
        if recorded is not None and recorded.path in offered:
            return recorded.path
        with self._lock:
            trial = self._trials.setdefault(shape.key, {})
            runs = {name: trial.get(name, (0, None)) for name in offered}
            if all(steps >= TRIAL_STEPS and times for steps, times in runs.values()):
                return self._settle_trial(
                    shape, {name: cast("list[float]", times) for name, (_, times) in runs.items()}
                )
            turn = min(offered, key=lambda name: runs[name][0])
            steps, times = runs[turn]
            trial[turn] = (steps + 1, times)
            return turn

    def _settle_trial(self, shape: ShapeClass, times: Mapping[str, list[float]]) -> str:
        """Record the choice of a class measured as the model runs it (under the lock)."""
        medians = {name: statistics.median(values) for name, values in times.items()}
        winner = min(medians, key=lambda name: medians[name])
        settled = all(medians[winner] * _TRIAL_MARGIN < value for name, value in medians.items() if name != winner)
        known = dict(self._choices if self._choices is not None else self._load())
        known[shape.key] = DispatchChoice(winner, medians, settled)
        self._choices = known
        del self._trials[shape.key]
        if settled:
            self._save({key: choice for key, choice in known.items() if choice.settled})
        return winner

    def record(self, shape: ShapeClass, path: str, seconds: float) -> None:
        """Record one layer's attention of a step of ``shape``'s class that ran ``path`` while
        the class is measured (:meth:`trial_path`); ignored once it is settled, and for a path
        that ran no trial step. The first time recorded for a path is its warm-up, left out."""
        with self._lock:
            trial = self._trials.get(shape.key)
            if trial is None or path not in trial or not seconds >= 0.0:
                return
            steps, times = trial[path]
            if times is None:
                trial[path] = (steps, [])  # the warm-up: compiling, first touches
            else:
                times.append(seconds)

    def forget(self) -> None:
        """Drop every choice and the calibration file: each class is measured again."""
        with self._lock:
            self._choices = {}
            self._trials = {}
            path = self._path()
            if path is not None:
                remove_file(str(path), what="the attention dispatch file")


def _decisive(winner: list[float], loser: list[float]) -> bool:
    """Whether timings of the winning path beat the loser's beyond noise: its fastest run 5%
    faster than the loser's and, with several rounds, its median below the loser's fastest.
    On a busy machine the timings overlap and nothing is settled (the next process measures
    again)."""
    if min(winner) * 1.05 >= min(loser):
        return False
    return len(winner) == 1 or statistics.median(winner) < min(loser)


def kernel_or_reference(config: CacheConfig) -> str:
    """The path of a NumPy-held pool (the NumPy and memmap backends): its pin
    (:func:`pinned_path`), where ``"auto"`` is the compiled kernel whenever it reads the pool
    (NumPy's own path is the reference, always the slower: nothing is measured), ``"native"``
    the reference.

    Raises:
        InvalidConfigError: ``KVCACHE_ATTENTION_PATH`` holds an unknown value.
        UnsupportedConfigError: ``attention_path="kernel"`` in the config where the kernel
            cannot run (numba missing or switched off, a dtype it does not read), the reason
            named. (Pinned by ``KVCACHE_ATTENTION_PATH``, the kernel runs where it can.)
    """
    if config.attention_path == "kernel":
        readable = (*KERNEL_DTYPES, *QUANTIZED_KERNEL_DTYPES)
        if config.dtype not in readable:
            raise UnsupportedConfigError(
                f"attention_path 'kernel' cannot run here: the kernel reads {', '.join(readable)} pools, "
                f"this one is {config.dtype}"
            )
        if not kernel_available():
            raise UnsupportedConfigError(
                f"attention_path 'kernel' cannot run here: numba is missing or {DISABLE_ENV} is set (pip install numba)"
            )
    return pinned_path(config.attention_path)
