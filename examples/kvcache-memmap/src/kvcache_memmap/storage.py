"""The memory-mapped storage and its plugin hook."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvcache_core import BackendSpec, CacheConfig, hookimpl
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError
from kvcache_core.numpy_backend import POLICY_CAPABILITIES, NumpyArray, NumpyStorage

__all__ = ["MemmapStorage", "kvcache_register_backends"]

Mode = Literal["w+", "r+"]

#: Geometry a reopened file must match (the sidecar ``<path>.json`` records it).
_GEOMETRY_FIELDS = ("num_layers", "num_heads", "head_dim", "num_blocks", "block_size", "dtype", "kv_layout")


def _geometry(config: CacheConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in _GEOMETRY_FIELDS}


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class MemmapStorage(NumpyStorage):
    """A kvcache pool in a memory-mapped file.

    Args:
        config: the pool's configuration (device ``cpu``).
        path: the pool file; ``None`` makes a temporary file, deleted when the storage is
            garbage-collected. A ``<path>.json`` sidecar records the geometry.
        mode: ``"w+"`` creates (or truncates) the file; ``"r+"`` reopens an existing
            pool, whose geometry must equal ``config``'s.

    Raises:
        InvalidArgumentError: a bad ``mode`` or ``path``; ``"r+"`` of a missing file.
        InvalidConfigError: ``"r+"`` of a pool built for another geometry.
    """

    def __init__(self, config: CacheConfig, *, path: str | os.PathLike[str] | None = None, mode: Mode = "w+") -> None:
        if mode not in ("w+", "r+"):
            raise InvalidArgumentError(f"mode must be 'w+' (create) or 'r+' (reopen), got {mode!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidArgumentError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        temporary = path is None
        if path is None:
            if mode == "r+":
                raise InvalidArgumentError("mode 'r+' reopens an existing pool: give its path")
            handle, name = tempfile.mkstemp(prefix="kvcache-", suffix=".kv")
            os.close(handle)
            path = name
        file = Path(path)
        sidecar = file.with_name(file.name + ".json")
        shape = self.pool_shape(config)
        if mode == "r+":
            if not file.exists() or not sidecar.exists():
                raise InvalidArgumentError(f"no kvcache pool at {str(file)!r} (or its .json sidecar) to reopen")
            try:
                recorded = json.loads(sidecar.read_text())
            except ValueError as exc:
                raise InvalidConfigError(f"the sidecar {str(sidecar)!r} of the pool is not valid JSON: {exc}") from exc
            if recorded != _geometry(config):
                raise InvalidConfigError(f"the pool at {str(file)!r} was built for {recorded}, not {_geometry(config)}")
            expected = math.prod(shape) * np.dtype(config.dtype).itemsize
            if file.stat().st_size != expected:
                raise InvalidConfigError(
                    f"the pool at {str(file)!r} holds {file.stat().st_size} bytes, its geometry needs {expected}"
                )
        pool: NumpyArray = np.memmap(file, dtype=np.dtype(config.dtype), mode=mode, shape=shape)
        if mode == "w+":
            sidecar.write_text(json.dumps(_geometry(config)))
        super().__init__(config, pool=pool)
        self._path = file
        if temporary:
            weakref.finalize(self, _remove_file, str(file))
            weakref.finalize(self, _remove_file, str(sidecar))

    @property
    def path(self) -> Path:
        """The pool file."""
        return self._path

    def flush(self) -> None:
        """Write dirty pages of the pool to the file."""
        pool = self.pool
        if isinstance(pool, np.memmap):
            pool.flush()


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    """Register the ``memmap`` backend."""
    yield BackendSpec(
        name="memmap",
        storage_factory=MemmapStorage,
        devices=("cpu",),
        dtypes=("float16", "float32"),
        kv_layouts=("NHD", "HND", "heads_first"),
        description="pool in a memory-mapped file (example third-party backend)",
        capabilities=POLICY_CAPABILITIES,  # the policies live in core; the NumPy kernels serve them
    )
