"""The pool's three paths, checked before anything is written, and files made atomically.

A pool at ``<path>`` has a ``<path>.json`` sidecar (its geometry) and, while live, a
``<path>.lock`` file. Only the last component of each is subject to ``follow_symlinks``:
the directories above are resolved, so one pool reached through two directory links
still has one lock file.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import secrets
import stat
from dataclasses import dataclass

from kvcache_memmap.errors import PoolPathError, PoolPathIsADirectoryError, PoolPathNotFoundError

__all__ = ["PoolPaths", "check_file", "create_file", "path_error", "read_small_file", "resolve_paths"]

#: Mode bits of a new file before the umask, as ``open(path, "w")`` gives.
_NEW_FILE_MODE = 0o666


@dataclass(frozen=True)
class PoolPaths:
    """Where a pool's files are (absolute; targets of symbolic links when following them)."""

    pool: str
    sidecar: str
    lock: str

    @property
    def directory(self) -> str:
        """The directory holding all three."""
        return os.path.dirname(self.pool)


def resolve_paths(path: str, *, follow_symlinks: bool) -> PoolPaths:
    """The pool, sidecar and lock paths of a pool file ``path``.

    Raises:
        PoolPathNotFoundError: the directory of ``path`` does not exist.
        PoolPathError: that directory is not a directory, or cannot be read.
    """
    absolute = os.path.abspath(path)
    directory, name = os.path.split(absolute)
    try:
        directory_stat = os.stat(directory)
    except FileNotFoundError as exc:
        raise PoolPathNotFoundError(
            f"the directory {directory!r} of the pool {path!r} does not exist: create it first", path=directory
        ) from exc
    except OSError as exc:
        raise path_error(exc, directory, what="the directory of the pool") from exc
    if not stat.S_ISDIR(directory_stat.st_mode):
        raise PoolPathError(
            f"the directory of the pool, {directory!r}, is not a directory",
            path=directory,
            error_code=errno_codes.ENOTDIR,
        )
    if not name:  # "/": the root directory itself
        raise PoolPathIsADirectoryError(f"the pool path {path!r} is a directory: name a file in it", path=absolute)
    pool = os.path.join(os.path.realpath(directory), name)
    if follow_symlinks:
        pool = os.path.realpath(pool)
        return PoolPaths(pool=pool, sidecar=os.path.realpath(pool + ".json"), lock=os.path.realpath(pool + ".lock"))
    return PoolPaths(pool=pool, sidecar=pool + ".json", lock=pool + ".lock")


def check_file(path: str, *, what: str, follow_symlinks: bool) -> os.stat_result | None:
    """The status of the regular file at ``path``, or ``None`` when there is none.

    Raises:
        PoolPathIsADirectoryError: ``path`` is a directory.
        PoolPathError: ``path`` is a symbolic link and ``follow_symlinks`` is false, or it
            is not a regular file (a FIFO, a device, ...), or cannot be examined.
    """
    try:
        status = os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise path_error(exc, path, what=what) from exc
    if stat.S_ISLNK(status.st_mode):
        raise _symlink_error(path, what)
    if stat.S_ISDIR(status.st_mode):
        raise PoolPathIsADirectoryError(f"{what} {path!r} is a directory: remove it or choose another path", path=path)
    if not stat.S_ISREG(status.st_mode):
        raise PoolPathError(f"{what} {path!r} is not a regular file: choose another path", path=path)
    return status


def create_file(directory: str, name: str, *, mode_of: os.stat_result | None) -> tuple[int, str]:
    """Open a new, empty, uniquely named hidden file in ``directory`` for reading and writing.

    It is meant to be filled, then moved over ``name`` with :func:`os.replace`, so a reader
    of ``name`` sees the old file or the new one, never a part of either.

    Args:
        directory: where to create it (the directory of ``name``, so the move is a rename).
        name: the file it will replace, for its temporary name.
        mode_of: the status of the file it will replace, whose permission bits it takes;
            ``None``: the umask's.

    Returns:
        ``(descriptor, path)``.

    Raises:
        PoolPathError: the file cannot be created (no permission, ...).
    """
    while True:
        temporary = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _NEW_FILE_MODE)
        except FileExistsError:
            continue
        except OSError as exc:
            raise path_error(exc, temporary, what="a new file beside the pool") from exc
        if mode_of is not None:
            with contextlib.suppress(OSError):  # the old file's bits are a courtesy, not a need
                os.fchmod(fd, stat.S_IMODE(mode_of.st_mode))
        return fd, temporary


def read_small_file(path: str, *, limit_bytes: int, what: str, follow_symlinks: bool) -> bytes | None:
    """The contents of the regular file ``path``, or ``None`` when it holds more than
    ``limit_bytes`` (no more than ``limit_bytes + 1`` are read).

    Raises:
        PoolPathError: ``path`` cannot be opened (the matching subclass), or is not a
            regular file (a FIFO, a device, ...).
    """
    # O_NONBLOCK: a FIFO put in place of a checked file must not hang the open.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise path_error(exc, path, what=what) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PoolPathError(f"{what} {path!r} is not a regular file: choose another path", path=path)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(limit_bytes + 1)
    except PoolPathError:
        raise
    except OSError as exc:
        raise path_error(exc, path, what=what) from exc
    finally:
        os.close(fd)
    return data if len(data) <= limit_bytes else None


def path_error(exc: OSError, path: str, *, what: str) -> PoolPathError:
    """The :class:`PoolPathError` subclass matching an ``OSError`` raised for ``path``."""
    if isinstance(exc, IsADirectoryError):
        return PoolPathIsADirectoryError(f"{what} {path!r} is a directory: remove it or choose another path", path=path)
    if isinstance(exc, FileNotFoundError):
        return PoolPathNotFoundError(
            f"{what} {path!r} cannot be created: a directory above it does not exist; create it first", path=path
        )
    if exc.errno == errno_codes.ELOOP:
        return _symlink_error(path, what)
    return PoolPathError(f"{what} {path!r} cannot be used: {exc.strerror or exc}", path=path, error_code=exc.errno)


def _symlink_error(path: str, what: str) -> PoolPathError:
    return PoolPathError(
        f"{what} {path!r} is a symbolic link: pass follow_symlinks=True to use its target, or choose another path",
        path=path,
        error_code=errno_codes.ELOOP,
    )
