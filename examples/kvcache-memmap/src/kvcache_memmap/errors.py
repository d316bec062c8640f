"""Errors of the memmap backend: kvcache errors that are also the builtin ``OSError`` kinds.

Each class inherits :class:`~kvcache_core.errors.KvCacheError` and the builtin a caller of
``open`` would catch, so ``except KvCacheError`` and ``except FileNotFoundError`` both work.
Each is raised before the pool's files change.
"""

from __future__ import annotations

import errno as errno_codes

from kvcache_core.errors import InvalidArgumentError, KvCacheError

__all__ = ["PoolLockedError", "PoolPathError", "PoolPathIsADirectoryError", "PoolPathNotFoundError"]


class PoolPathError(InvalidArgumentError, OSError):
    """The pool file, its ``.json`` sidecar or its ``.lock`` file cannot be used at the path
    given: a symbolic link not asked for (``errno`` ``ELOOP``), a parent that is not a
    directory, something that is not a regular file, no permission, ...

    ``errno`` is the operating system's error code (``None`` when none applies) and
    ``filename`` the path at fault; ``str()`` is the whole message.
    """

    def __init__(self, message: str, *, path: str, error_code: int | None = None) -> None:
        super().__init__(message)
        self.errno = error_code
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])


class PoolPathIsADirectoryError(PoolPathError, IsADirectoryError):
    """The pool or sidecar path names a directory."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, path=path, error_code=errno_codes.EISDIR)


class PoolPathNotFoundError(PoolPathError, FileNotFoundError):
    """The directory that should hold the pool does not exist, or ``mode="r+"`` found no
    pool (or no sidecar) to reopen."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message, path=path, error_code=errno_codes.ENOENT)


class PoolLockedError(KvCacheError, BlockingIOError):
    """Another live pool (in this process or another) holds the file lock of this path.

    ``filename`` is the pool file, ``holder_pid`` the process id recorded by the holder
    (``None`` when it cannot be read). Close the other pool, or use another path.
    """

    def __init__(self, message: str, *, path: str, holder_pid: int | None) -> None:
        super().__init__(message)
        self.errno = errno_codes.EWOULDBLOCK
        self.filename = path
        self.holder_pid = holder_pid

    def __str__(self) -> str:
        return str(self.args[0])
