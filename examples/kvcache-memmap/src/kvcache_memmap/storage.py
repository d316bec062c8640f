"""The memory-mapped storage and its plugin hook."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvcache_core.backends.numpy import (
    NUMPY_COMPUTE_DTYPES,
    NUMPY_DTYPES,
    PREFERRED_LAYOUT,
    NumpyArray,
    NumpyStorage,
)
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, UnsupportedConfigError
from kvcache_core.plugin import (
    ATTENTION_CAPABILITIES,
    MEMORY_REGIONS,
    POLICY_CAPABILITIES,
    QUANTIZED_DTYPES,
    STATE_LAYERS,
    VALUE_HEAD_DIM,
    BackendSpec,
    CacheConfig,
    hookimpl,
)
from kvcache_memmap._lock import PoolLock, acquire_lock, lock_pool_file, same_file
from kvcache_memmap._paths import PoolPaths, check_file, create_file, path_error, read_small_file, resolve_paths
from kvcache_memmap.errors import PoolPathError, PoolPathNotFoundError

__all__ = ["MEMMAP_DTYPES", "MemmapStorage", "kvcache_register_backends"]

Mode = Literal["w+", "r+"]
#: The mapped arrays of a pool file: the blocks, and a quantized pool's scales.
Mapped = tuple[NumpyArray, "NumpyArray | None"]

#: Geometry a reopened file must match (the sidecar ``<path>.json`` records it).
_GEOMETRY_FIELDS = ("num_layers", "num_heads", "head_dim", "num_blocks", "block_size", "dtype", "kv_layout")

#: A sidecar records seven short fields; anything much larger is not one.
_SIDECAR_LIMIT_BYTES = 64 * 1024

#: The dtypes of a memmap pool: float16, float32 and the quantized ones NumPy holds here
#: (float8 needs ``ml_dtypes``).
MEMMAP_DTYPES = ("float16", "float32", *(dtype for dtype in QUANTIZED_DTYPES if dtype in NUMPY_DTYPES))

#: Where a quantized pool's scales start in its file: past the raw blocks, at this alignment.
_SCALES_ALIGNMENT_BYTES = 64


def _geometry(config: CacheConfig) -> dict[str, Any]:
    geometry = {name: getattr(config, name) for name in _GEOMETRY_FIELDS}
    if config.value_head_dim is not None:  # recorded only when set: earlier sidecars still match
        geometry["value_head_dim"] = config.value_head_dim
    return geometry


@dataclass(frozen=True)
class _FileLayout:
    """Where the arrays of a pool lie in its file: the blocks from byte 0, then (quantized
    pools) their float32 scales ``[num_layers, 2, num_heads, num_blocks, block_size]``."""

    pool_shape: tuple[int, ...]
    element: np.dtype[Any]
    scales_shape: tuple[int, ...] | None
    scales_offset: int
    size_bytes: int

    @classmethod
    def of(cls, config: CacheConfig) -> _FileLayout:
        pool_shape = MemmapStorage.pool_shape(config)
        element = MemmapStorage.element_dtype(config)
        pool_bytes = math.prod(pool_shape) * element.itemsize
        scales_shape = MemmapStorage.scales_shape(config)
        if scales_shape is None:
            return cls(pool_shape, element, None, pool_bytes, pool_bytes)
        offset = -(-pool_bytes // _SCALES_ALIGNMENT_BYTES) * _SCALES_ALIGNMENT_BYTES
        scale_bytes = math.prod(scales_shape) * np.dtype(np.float32).itemsize
        return cls(pool_shape, element, scales_shape, offset, offset + scale_bytes)


class MemmapStorage(NumpyStorage):
    """A kvcache pool in a memory-mapped file.

    A quantized pool (``int8``, ``float8_e4m3fn``: :mod:`kvcache_core.contract.quantization`) keeps its
    raw blocks and, after them in the same file, their float32 scales, so a reopened pool
    decodes what was written.

    Recurrent-state layers (``LayerSpec(state=...)``, capability ``"state_layers"``) keep
    their states in process memory (:meth:`NumpyStorage.state_storage`): a state belongs to
    a live request (and a checkpoint to the manager's prefix cache), neither of which
    outlives the process, so the file holds K/V only and its geometry is the attention
    layers' (``save_prefix_cache`` carries checkpoints across processes).

    While the storage is live it holds two exclusive locks (``fcntl.flock``): one on
    ``<path>.lock``, recording its pid there, and one on the pool file itself. A second
    storage on the same file, in this process or another, is refused instead of
    overwriting the pool under the first, whatever name it is opened through (the same
    path, a hard link, a symbolic link). :meth:`close` (or the storage's garbage
    collection) releases both.

    A new pool is written to a temporary file beside ``path`` and moved over it
    (``os.replace``) only once every check has passed: an existing pool is never truncated
    or zeroed by an open that fails, and a process still mapping the old file keeps it.

    Args:
        config: the pool's configuration (device ``cpu``; dtype one of :data:`MEMMAP_DTYPES`).
        path: the pool file; ``None`` makes a temporary pool in a new private directory,
            deleted with it when the storage is closed or garbage-collected. A
            ``<path>.json`` sidecar records the geometry.
        mode: ``"w+"`` creates the pool (replacing one already at ``path``, zeroed);
            ``"r+"`` reopens an existing pool, whose geometry must equal ``config``'s.
        follow_symlinks: use the targets of symbolic links at ``path`` and at its
            sidecar and lock paths; by default such a link is refused, so an open
            never writes through a link into a file elsewhere.

    Raises:
        InvalidArgumentError: a ``mode`` other than ``"w+"`` and ``"r+"``, an empty ``path``
            or one holding a NUL character.
        InvalidTypeError: ``config`` is not a :class:`CacheConfig`, ``mode`` not a str,
            ``path`` not a str or path, ``follow_symlinks`` not a bool.
        PoolLockedError: another live storage holds ``path`` (the message names its pid),
            or the same file through another name.
        PoolPathIsADirectoryError: ``path`` or its sidecar is a directory.
        PoolPathNotFoundError: the directory of ``path`` does not exist; ``"r+"`` of a
            missing pool or sidecar.
        PoolPathError: a symbolic link without ``follow_symlinks``, something that is not
            a regular file, or another operating-system error on one of the pool's files.
        InvalidConfigError: ``"r+"`` of a pool built for another geometry, of a pool file
            of the wrong size, or of a sidecar that is not a small JSON object.
        UnsupportedConfigError: a dtype not in :data:`MEMMAP_DTYPES`, or a quantized pool
            whose compute dtype NumPy does not hold (nothing is created).
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        path: str | os.PathLike[str] | None = None,
        mode: Mode = "w+",
        follow_symlinks: bool = False,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        config = config.with_layout(PREFERRED_LAYOUT)  # kv_layout=None: NumPy's fastest
        if config.dtype not in MEMMAP_DTYPES:
            raise UnsupportedConfigError(
                f"dtype {config.dtype!r} is not offered by the memmap backend (supported: {', '.join(MEMMAP_DTYPES)})"
            )
        if config.quantized and config.io_dtype not in NUMPY_COMPUTE_DTYPES:
            raise UnsupportedConfigError(
                f"a quantized memmap pool computes in {', '.join(NUMPY_COMPUTE_DTYPES)}; got compute_dtype "
                f"{config.io_dtype!r}"
            )
        if not isinstance(mode, str):
            raise InvalidTypeError(f"mode must be 'w+' (create) or 'r+' (reopen), got {type(mode).__name__}")
        if mode not in ("w+", "r+"):
            raise InvalidArgumentError(f"mode must be 'w+' (create) or 'r+' (reopen), got {mode!r}")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidTypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        if not isinstance(follow_symlinks, bool):
            raise InvalidTypeError(f"follow_symlinks must be a bool, got {type(follow_symlinks).__name__}")
        # A temporary pool lives in a new private directory (mode 0o700), so no other user
        # can plant or predict anything beside it.
        private_directory: str | None = None
        if path is None:
            if mode == "r+":
                raise InvalidArgumentError("mode 'r+' reopens an existing pool: give its path")
            try:
                private_directory = tempfile.mkdtemp(prefix="kvcache-")
            except OSError as exc:
                raise path_error(exc, tempfile.gettempdir(), what="the directory of a temporary pool") from exc
            path_text = os.path.join(private_directory, "pool.kv")
        else:
            path_text = os.fsdecode(os.fspath(path))
            if not path_text:
                raise InvalidArgumentError("path must name a file, got ''")
            if "\0" in path_text:
                raise InvalidArgumentError(f"path must not contain a NUL character, got {path_text!r}")
        try:
            paths = resolve_paths(path_text, follow_symlinks=follow_symlinks)
            lock = acquire_lock(paths.lock, pool_path=paths.pool)
        except BaseException:
            _remove_files(os.getpid(), (), private_directory)
            raise
        owned = (paths.pool, paths.sidecar) if private_directory is not None else ()
        try:
            if mode == "w+":
                pool, scales = _create_pool(paths, config, lock, follow_symlinks=follow_symlinks)
            else:
                pool, scales = _reopen_pool(paths, config, lock, follow_symlinks=follow_symlinks)
            super().__init__(config, pool=pool, scales=scales)
        except BaseException:
            _release(lock, owned, private_directory)
            raise
        self._file_path = Path(paths.pool)
        self._temporary = private_directory is not None
        # The fallback for a storage dropped without close(): it must not refer to self.
        self._finalizer = weakref.finalize(self, _release, lock, owned, private_directory)

    @property
    def path(self) -> Path:
        """The pool file (absolute; the link's target when following symbolic links)."""
        return self._file_path

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` released the pool's files."""
        return not self._finalizer.alive

    def flush(self) -> None:
        """Write dirty pages of the pool (and of a quantized pool's scales) to the file."""
        for mapped in (self.pool, self.scales):
            if isinstance(mapped, np.memmap):
                mapped.flush()

    def close(self) -> None:
        """Flush the pool and release its lock, so its path can be opened again.

        Idempotent. A temporary pool's files are deleted. Arrays taken from the storage
        stay readable (the mapping lives as long as they do), but the file is no longer
        protected: write nothing more through this storage.
        """
        if not self._finalizer.alive:
            return
        if not self._temporary:
            self.flush()
        self._finalizer()


def _create_pool(paths: PoolPaths, config: CacheConfig, lock: PoolLock, *, follow_symlinks: bool) -> Mapped:
    """A zeroed pool file and its sidecar, moved into place once both are complete; the new
    file is locked (``lock`` holds it) before it is mapped."""
    pool_status = check_file(paths.pool, what="the pool file", follow_symlinks=follow_symlinks)
    sidecar_status = check_file(paths.sidecar, what="the sidecar of the pool", follow_symlinks=follow_symlinks)
    layout = _FileLayout.of(config)
    created: list[str] = []
    # The file the name holds now may be another live pool's, opened through another name:
    # it stays locked until the new file replaces it here.
    replaced_fd = None if pool_status is None else lock_pool_file(paths.pool, pool_path=paths.pool)
    try:
        pool_fd, pool_temporary = create_file(paths.directory, os.path.basename(paths.pool), mode_of=pool_status)
        created.append(pool_temporary)
        try:
            lock.hold_pool_file(lock_pool_file(pool_temporary, pool_path=paths.pool, same_as=pool_fd))
            try:
                os.ftruncate(pool_fd, layout.size_bytes)  # sparse: the zeros cost no disk until written
                mapped = _map(pool_fd, layout)
            except OSError as exc:
                raise path_error(exc, pool_temporary, what="the new pool file") from exc
        finally:
            os.close(pool_fd)
        sidecar_fd, sidecar_temporary = create_file(
            paths.directory, os.path.basename(paths.sidecar), mode_of=sidecar_status
        )
        created.append(sidecar_temporary)
        try:
            with os.fdopen(sidecar_fd, "wb", closefd=False) as sidecar:
                sidecar.write(json.dumps(_geometry(config)).encode())
        except OSError as exc:
            raise path_error(exc, sidecar_temporary, what="the new sidecar") from exc
        finally:
            os.close(sidecar_fd)
        for temporary, final in ((pool_temporary, paths.pool), (sidecar_temporary, paths.sidecar)):
            try:
                os.replace(temporary, final)
            except OSError as exc:
                raise path_error(exc, final, what="the pool's file") from exc
            created.remove(temporary)
    except BaseException:
        _remove_files(os.getpid(), created)
        raise
    finally:
        if replaced_fd is not None:
            os.close(replaced_fd)
    return mapped


def _reopen_pool(paths: PoolPaths, config: CacheConfig, lock: PoolLock, *, follow_symlinks: bool) -> Mapped:
    """The existing pool at ``paths``, locked (``lock`` holds it), after its sidecar and
    size match ``config``."""
    pool_status = check_file(paths.pool, what="the pool file", follow_symlinks=follow_symlinks)
    sidecar_status = check_file(paths.sidecar, what="the sidecar of the pool", follow_symlinks=follow_symlinks)
    if pool_status is None or sidecar_status is None:
        missing = paths.pool if pool_status is None else paths.sidecar
        raise PoolPathNotFoundError(
            f"no kvcache pool at {paths.pool!r} (or its .json sidecar) to reopen: {missing!r} does not exist; "
            "create the pool with mode='w+'",
            path=missing,
        )
    locked_fd = lock_pool_file(paths.pool, pool_path=paths.pool)
    lock.hold_pool_file(locked_fd)
    data = read_small_file(
        paths.sidecar, limit_bytes=_SIDECAR_LIMIT_BYTES, what="the sidecar of the pool", follow_symlinks=follow_symlinks
    )
    if data is None:
        raise InvalidConfigError(
            f"the sidecar {paths.sidecar!r} of the pool holds more than {_SIDECAR_LIMIT_BYTES} bytes: "
            "it is not a kvcache sidecar"
        )
    try:
        recorded = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested too deep
        raise InvalidConfigError(f"the sidecar {paths.sidecar!r} of the pool is not valid JSON: {exc}") from exc
    if recorded != _geometry(config):
        raise InvalidConfigError(f"the pool at {paths.pool!r} was built for {recorded}, not {_geometry(config)}")
    layout = _FileLayout.of(config)
    # The path is resolved: a link there now was planted since, and is not followed.
    try:
        pool_fd = os.open(paths.pool, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise path_error(exc, paths.pool, what="the pool file") from exc
    try:
        if not same_file(pool_fd, locked_fd):
            raise PoolPathError(
                f"the pool file {paths.pool!r} was replaced by another program while being opened: retry",
                path=paths.pool,
            )
        size_bytes = os.fstat(pool_fd).st_size
        if size_bytes != layout.size_bytes:
            raise InvalidConfigError(
                f"the pool at {paths.pool!r} holds {size_bytes} bytes, its geometry needs {layout.size_bytes}"
            )
        return _map(pool_fd, layout)
    except PoolPathError:
        raise
    except OSError as exc:
        raise path_error(exc, paths.pool, what="the pool file") from exc
    finally:
        os.close(pool_fd)


def _map(fd: int, layout: _FileLayout) -> Mapped:
    """Map the open file ``fd`` (already of the layout's size) read-write: the blocks, and
    a quantized pool's scales."""
    with os.fdopen(fd, "r+b", closefd=False) as file:
        pool: NumpyArray = np.memmap(file, dtype=layout.element, mode="r+", shape=layout.pool_shape)
        scales: NumpyArray | None = None
        if layout.scales_shape is not None:
            scales = np.memmap(
                file, dtype=np.float32, mode="r+", shape=layout.scales_shape, offset=layout.scales_offset
            )
    return pool, scales


def _release(lock: PoolLock, owned: tuple[str, ...], private_directory: str | None) -> None:
    """Delete a temporary pool's files, release its locks, then remove its directory."""
    _remove_files(lock.owner_pid, owned)
    lock.release()
    _remove_files(lock.owner_pid, (), private_directory)


def _remove_files(owner_pid: int, paths: tuple[str, ...] | list[str], directory: str | None = None) -> None:
    """Delete ``paths``, then the (emptied) ``directory``; only in the process that made them."""
    if os.getpid() != owner_pid:  # a forked child does not own its parent's files
        return
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if directory is not None:
        with contextlib.suppress(OSError):  # not empty: someone else's file is not ours to delete
            os.rmdir(directory)


@hookimpl
def kvcache_register_backends() -> Iterator[BackendSpec[NumpyArray]]:
    """Register the ``memmap`` backend."""
    yield BackendSpec(
        name="memmap",
        storage_factory=MemmapStorage,
        is_available=lambda: os.name == "posix",
        unavailable_reason=lambda: "the memmap backend locks its files with fcntl.flock, which needs a POSIX system",
        devices=("cpu",),
        dtypes=MEMMAP_DTYPES,
        kv_layouts=("NHD", "HND", "heads_first"),
        preferred_layout=PREFERRED_LAYOUT,
        description="pool in a memory-mapped file (example third-party backend)",
        # The policies live in core; the NumPy kernels serve them, every attention feature and
        # values of another width than the keys; the pool's memory regions are the file's mapping.
        # state_layers: NumpyStorage.state_storage, in process memory (see MemmapStorage)
        capabilities=POLICY_CAPABILITIES | ATTENTION_CAPABILITIES | {MEMORY_REGIONS, VALUE_HEAD_DIM, STATE_LAYERS},
    )
