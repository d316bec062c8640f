"""The attention dispatch's calibration files (:mod:`kvcache_core.backends.dispatch`): the
machine key a file must match, the file's name and directory, its strict reading.

One file per backend and machine key (CPU model, usable cores, Python, the backend's library
versions), named by a digest of the key, so machines sharing a directory and new versions keep
files of their own. Its names are re-exported by :mod:`kvcache_core.backends.dispatch`, where
they are documented for users.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

from kvcache_core.contract.config import ATTENTION_PATHS
from kvcache_core.errors import CorruptCacheFileError, InvalidArgumentError, InvalidTypeError
from kvcache_core.offload.safe_files import RegularFile
from kvcache_core.offload.strict_json import parse_json

__all__ = [
    "CACHE_DIR_ENV",
    "FILE_FORMAT",
    "FILE_VERSION",
    "MAX_FILE_BYTES",
    "DispatchChoice",
    "cache_directory",
    "check_backend_name",
    "dispatch_file_backend",
    "dispatch_file_name",
    "machine_key",
    "read_dispatch_file",
]

#: The environment variable naming the directory of the calibration files (``off``: none).
CACHE_DIR_ENV: Final = "KVCACHE_CACHE_DIR"
#: The largest calibration file read (bytes); a larger one is ignored.
MAX_FILE_BYTES: Final = 1 << 20
#: The format and version a calibration file declares.
FILE_FORMAT: Final = "kvcache-attention-dispatch"
FILE_VERSION: Final = 1
#: A backend name that may stand in a calibration file's name (:func:`check_backend_name`).
_BACKEND_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _usable_cores() -> int:
    affinity: Callable[[int], set[int]] | None = getattr(os, "sched_getaffinity", None)
    count = len(affinity(0)) if affinity is not None else os.cpu_count()
    return max(1, count or 1)


def machine_key(libraries: Mapping[str, str]) -> dict[str, str]:
    """What a calibration file must match to be used: the CPU model, the usable cores, the
    Python version and ``libraries`` (name -> version: kvcache-core's, the backend's)."""
    key = {"cpu": _cpu_model(), "cores": str(_usable_cores()), "python": platform.python_version()}
    key.update({name: str(version) for name, version in sorted(libraries.items())})
    return key


def check_backend_name(backend: object) -> str:
    """``backend``, a name that may stand in a file name: 1 to 64 ASCII letters, digits,
    ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``.

    Raises:
        InvalidTypeError: not a str. InvalidArgumentError: another name.
    """
    if not isinstance(backend, str):
        raise InvalidTypeError(f"a backend's name is a str, got {type(backend).__name__}")
    if not _BACKEND_NAME.fullmatch(backend):
        raise InvalidArgumentError(
            f"a backend's name for its calibration file is 1 to 64 ASCII letters, digits, '_', '.' and '-', "
            f"not starting with '.' or '-'; got {backend[:80]!r}"
        )
    return backend


def dispatch_file_name(backend: str, machine: Mapping[str, str]) -> str:
    """The name of ``backend``'s calibration file for the machine key ``machine``
    (:func:`machine_key`): ``dispatch-<backend>-<digest>.json``, the digest the first 16 hex
    digits of the key's SHA-256 (its fields sorted), so machines and versions sharing a
    directory keep files of their own.

    Raises:
        InvalidTypeError, InvalidArgumentError: ``backend`` is not a name
            :func:`check_backend_name` takes. InvalidTypeError: ``machine`` is not a mapping
            of str to str.
    """
    check_backend_name(backend)
    if not isinstance(machine, Mapping) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in machine.items()
    ):
        raise InvalidTypeError(f"a machine key is a mapping of str to str, got {type(machine).__name__}")
    text = json.dumps(dict(machine), sort_keys=True, separators=(",", ":"))
    return f"dispatch-{backend}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def dispatch_file_backend(name: str) -> str | None:
    """The backend of a calibration file named ``name`` (:func:`dispatch_file_name`, or
    ``dispatch-<backend>.json`` as kvcache-core 0.3 named it); ``None`` for another name,
    or one whose backend :func:`check_backend_name` would refuse.

    Raises:
        InvalidTypeError: ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"a calibration file's name is a str, got {type(name).__name__}")
    if not name.startswith("dispatch-") or not name.endswith(".json"):
        return None
    stem = name[len("dispatch-") : -len(".json")]
    backend, _, digest = stem.rpartition("-")
    if not (backend and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
        backend = stem  # kvcache-core 0.3's name
    return backend if _BACKEND_NAME.fullmatch(backend) else None


def cache_directory() -> Path | None:
    """Where calibration files live (see :mod:`kvcache_core.backends.dispatch`); ``None`` when switched off."""
    chosen = os.environ.get(CACHE_DIR_ENV, "")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME", "") or str(Path.home() / ".cache")
    return Path(base) / "kvcache"


@dataclass(frozen=True, slots=True)
class DispatchChoice:
    """The path a shape class runs and the fewest seconds each path took when it was calibrated."""

    path: str
    seconds: Mapping[str, float]
    #: Whether the calibration was decisive (beyond the noise: :class:`~kvcache_core.backends.dispatch.AttentionDispatch`): only such choices are kept on
    #: disk; an undecided one holds for this process, and the next process measures again.
    settled: bool = True


def read_dispatch_file(path: str | Path) -> tuple[dict[str, str], dict[str, DispatchChoice]]:
    """The machine a calibration file was measured on and its choices, checked strictly.

    Raises:
        CacheFileError: the file cannot be read (missing, a link, not a regular file).
        CorruptCacheFileError: it is not a calibration file, or larger than :data:`MAX_FILE_BYTES`.
    """
    with RegularFile(str(path), what="the attention dispatch file") as file:
        if file.size > MAX_FILE_BYTES:
            raise CorruptCacheFileError(f"{str(path)!r} holds {file.size} bytes, more than the {MAX_FILE_BYTES} read")
        data = file.read_at(0, file.size)
    body = parse_json(data, what="the attention dispatch file", error=CorruptCacheFileError)
    try:
        choices = _parse(body, None)
    except ValueError as exc:
        raise CorruptCacheFileError(f"{str(path)!r}: {exc}") from exc
    return _texts(cast("dict[str, object]", body)["machine"], "its machine"), choices


def _parse(body: object, machine: Mapping[str, str] | None) -> dict[str, DispatchChoice]:
    """The choices of a calibration file's JSON, checked field by field.

    Raises:
        ValueError: a field missing, of another type, or the file from another machine or
            versions (when ``machine`` is given).
    """
    if not isinstance(body, dict):
        raise ValueError("it is not an attention dispatch file")
    fields = cast("dict[str, object]", body)
    if set(fields) != {"format", "version", "machine", "choices"}:
        raise ValueError("it is not an attention dispatch file")
    if fields["format"] != FILE_FORMAT or fields["version"] != FILE_VERSION:
        raise ValueError(
            f"format {fields['format']!r} version {fields['version']!r}, expected {FILE_FORMAT!r} {FILE_VERSION}"
        )
    recorded = _texts(fields["machine"], "its machine")
    if machine is not None and recorded != dict(machine):
        raise ValueError(f"it was measured on {recorded!r}, this is {dict(machine)!r}")
    listed = fields["choices"]
    if not isinstance(listed, dict):
        raise ValueError("its choices are not a mapping")
    choices: dict[str, DispatchChoice] = {}
    for key, entry in cast("dict[str, object]", listed).items():
        if not isinstance(entry, dict) or set(cast("dict[str, object]", entry)) != {"path", "seconds"}:
            raise ValueError(f"the choice {key!r} is malformed")
        parts = cast("dict[str, object]", entry)
        path, seconds = parts["path"], parts["seconds"]
        if not isinstance(path, str) or path not in ATTENTION_PATHS[1:] or not isinstance(seconds, dict):
            raise ValueError(f"the choice {key!r} names the path {path!r}")
        timed: dict[str, float] = {}
        for name, value in cast("dict[str, object]", seconds).items():
            if name not in ATTENTION_PATHS[1:] or not isinstance(value, float) or not value >= 0.0:
                raise ValueError(f"the choice {key!r} has a bad time {name!r}: {value!r}")
            timed[name] = value
        choices[key] = DispatchChoice(path, timed)
    return choices


def _texts(value: object, what: str) -> dict[str, str]:
    """``value`` if it is a JSON object of texts."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a mapping of texts")
    items = cast("dict[str, object]", value)
    texts = {name: text for name, text in items.items() if isinstance(text, str)}
    if len(texts) != len(items):
        raise ValueError(f"{what} is not a mapping of texts")
    return texts
