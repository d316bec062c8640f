"""The exclusive advisory lock a live pool holds on ``<pool>.lock`` (``fcntl.flock``).

The lock file is never replaced while held: the holder writes its pid into it, and
removes it while still holding the lock, as it releases. An opener that locked a file
the holder has just removed sees that the path now names another file (or none) and
tries again, so two live pools never hold a lock on the same path.

``flock`` locks belong to the open file description: a second ``open`` in the same
process is refused like one in another process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from kvcache_memmap._paths import path_error
from kvcache_memmap.errors import PoolLockedError

__all__ = ["PoolLock", "acquire_lock"]

#: How often to retry when each lock taken is found removed by a holder releasing it.
_ATTEMPTS = 16

#: Bytes read from a lock file for its holder's pid.
_PID_BYTES = 32


@dataclass
class PoolLock:
    """A held lock: the locked file's descriptor and path, and the process that took it."""

    fd: int
    path: str
    owner_pid: int = field(default_factory=os.getpid)
    released: bool = False

    def release(self) -> None:
        """Remove the lock file and unlock it (idempotent).

        A process forked from the owner shares the descriptor but not the lock's
        ownership: it only closes its copy.
        """
        if self.released:
            return
        self.released = True
        if os.getpid() == self.owner_pid and _names_same_file(self.path, self.fd, follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still locked: see the module docstring
        os.close(self.fd)


def acquire_lock(lock_path: str, *, pool_path: str, follow_symlinks: bool) -> PoolLock:
    """Take the exclusive lock of a pool, without waiting.

    Args:
        lock_path: the lock file, ``<pool>.lock``; created when missing.
        pool_path: the pool file, for messages.
        follow_symlinks: whether a symbolic link at ``lock_path`` is followed.

    Raises:
        PoolLockedError: another live pool holds the lock; the message names the holder's
            pid when it recorded one.
        PoolPathError: the lock file cannot be opened (a directory, a refused symbolic link,
            a missing parent, no permission, ...): the matching subclass.
    """
    import fcntl  # here, not at the top: the plugin module must import everywhere (POSIX only)

    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(lock_path, flags, 0o666)
        except OSError as exc:
            raise path_error(exc, lock_path, what="the lock file of the pool") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder_pid = _read_pid(fd)
            os.close(fd)
            raise PoolLockedError(
                f"the kvcache pool at {pool_path!r} is in use by {_describe(holder_pid)} (lock file {lock_path!r}): "
                "close that pool (storage.close() or manager.close()) or choose another path",
                path=pool_path,
                holder_pid=holder_pid,
            ) from exc
        except OSError as exc:
            os.close(fd)
            raise path_error(exc, lock_path, what="the lock file of the pool") from exc
        if _names_same_file(lock_path, fd, follow_symlinks=follow_symlinks):
            lock = PoolLock(fd=fd, path=lock_path)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                lock.release()
                raise path_error(exc, lock_path, what="the lock file of the pool") from exc
            return lock
        os.close(fd)  # the holder removed this file as it released it: lock the new one
    raise PoolLockedError(
        f"the lock file {lock_path!r} of the kvcache pool at {pool_path!r} was replaced {_ATTEMPTS} times "
        "while being locked: another program is removing it; retry, or choose another path",
        path=pool_path,
        holder_pid=None,
    )


def _names_same_file(path: str, fd: int, *, follow_symlinks: bool) -> bool:
    try:
        at_path = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError:
        return False
    held = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, _PID_BYTES, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _describe(holder_pid: int | None) -> str:
    if holder_pid is None:
        return "another pool (holder unknown)"
    if holder_pid == os.getpid():
        return f"another pool of this process (pid {holder_pid})"
    return f"process {holder_pid}"
