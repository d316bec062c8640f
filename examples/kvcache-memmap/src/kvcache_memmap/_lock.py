"""The exclusive advisory locks a live pool holds (``fcntl.flock``): one on ``<pool>.lock``,
by the pool's name, and one on the pool file itself, by its identity.

The lock file is never replaced while held: the holder writes its pid into it, and
removes it while still holding the lock, as it releases. An opener that locked a file
the holder has just removed sees that the path now names another file (or none) and
tries again, so two live pools never hold a lock on the same path.

The lock on the pool file is taken on an open file description of its own, not the one
the mapping uses (a mapping keeps its descriptor as long as an array of it lives): it
belongs to the file, not to a name, so a second open of the file through any other name
(a hard link, a symbolic link, another mount of its directory) is refused too, and it
ends with ``close``, whatever arrays remain.

``flock`` locks belong to the open file description: a second ``open`` in the same
process is refused like one in another process.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field

from kvcache_memmap._paths import path_error
from kvcache_memmap.errors import PoolLockedError, PoolPathError

__all__ = ["PoolLock", "acquire_lock", "lock_pool_file", "same_file"]

#: How often to retry when each lock taken is found removed by a holder releasing it.
_ATTEMPTS = 16

#: Bytes read from a lock file for its holder's pid.
_PID_BYTES = 32


@dataclass
class PoolLock:
    """A held lock: the lock file's descriptor and path, the process that took it, and the
    locked descriptor of the pool file once :meth:`hold_pool_file` gave it."""

    fd: int
    path: str
    owner_pid: int = field(default_factory=os.getpid)
    released: bool = False
    pool_file_fd: int | None = None

    def hold_pool_file(self, fd: int) -> None:
        """Keep ``fd``, a descriptor :func:`lock_pool_file` locked, until :meth:`release`."""
        self.pool_file_fd = fd

    def release(self) -> None:
        """Unlock the pool file, remove the lock file and unlock it (idempotent).

        A process forked from the owner shares the descriptors but not the locks'
        ownership: it only closes its copies.
        """
        if self.released:
            return
        self.released = True
        if self.pool_file_fd is not None:
            os.close(self.pool_file_fd)
        if os.getpid() == self.owner_pid and _names_same_file(self.path, self.fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still locked: see the module docstring
        os.close(self.fd)


def acquire_lock(lock_path: str, *, pool_path: str) -> PoolLock:
    """Take the exclusive lock of a pool's name, without waiting.

    Args:
        lock_path: the lock file, ``<pool>.lock`` (resolved: a symbolic link there is
            refused); created when missing.
        pool_path: the pool file, for messages.

    Raises:
        PoolLockedError: another live pool holds the lock; the message names the holder's
            pid when it recorded one.
        PoolPathError: the lock file cannot be opened (a directory, a refused symbolic link,
            a missing parent, no permission, ...): the matching subclass.
    """
    import fcntl  # here, not at the top: the plugin module must import everywhere (POSIX only)

    # Never through a link: the file is truncated and written. A link the caller chose to
    # follow was resolved into lock_path already; one there now was planted since.
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(lock_path, flags, 0o666)
        except OSError as exc:
            raise path_error(exc, lock_path, what="the lock file of the pool") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device: opened without blocking
            os.close(fd)
            raise PoolPathError(
                f"the lock file of the pool {lock_path!r} is not a regular file: remove it", path=lock_path
            )
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
        if _names_same_file(lock_path, fd):
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


def lock_pool_file(path: str, *, pool_path: str, same_as: int | None = None) -> int:
    """Open the pool file at ``path`` as a new open file description and lock it
    exclusively, without waiting; its descriptor (read-only), for :meth:`PoolLock.hold_pool_file`.

    Args:
        path: the pool file, or the new file that will become it (resolved: a symbolic
            link there is refused).
        pool_path: the pool file, for messages.
        same_as: a descriptor of the file ``path`` must still name (one just created).

    Raises:
        PoolLockedError: another live pool holds this file, through this name or another.
        PoolPathError: it cannot be opened, is not a regular file, or ``path`` no longer
            names the file ``same_as`` does.
    """
    import fcntl  # here, not at the top: the plugin module must import everywhere (POSIX only)

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise path_error(exc, path, what="the pool file") from exc
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode):
            raise PoolPathError(f"the pool file {path!r} is not a regular file: choose another path", path=path)
        if same_as is not None and not same_file(fd, same_as):
            raise PoolPathError(
                f"the pool file {path!r} was replaced by another program while being opened: retry", path=path
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PoolLockedError(
                f"the kvcache pool at {pool_path!r} is in use: another live pool opened the same file "
                f"(device {held.st_dev}, inode {held.st_ino}) through another name (a hard link, a symbolic "
                "link or another mount of its directory); close that pool or choose another file",
                path=pool_path,
                holder_pid=None,
            ) from exc
        except OSError as exc:
            raise path_error(exc, path, what="the pool file") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(first_fd: int, second_fd: int) -> bool:
    """Whether two descriptors are open on the same file (device and inode)."""
    return _same_identity(os.fstat(first_fd), os.fstat(second_fd))


def _same_identity(first: os.stat_result, second: os.stat_result) -> bool:
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _names_same_file(path: str, fd: int) -> bool:
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return _same_identity(at_path, os.fstat(fd))


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
