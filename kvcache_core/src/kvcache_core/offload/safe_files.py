"""Files written whole and read safely: the two file primitives of the prefix-cache file
and the disk tier.

* :func:`write_file_atomically` writes to a temporary file created exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``) under an unpredictable name in the target's
  directory, flushes it to disk and renames it over the target. A symbolic link planted
  at any name is never followed, writers of one path never share a temporary name, and a
  reader sees the old file or the new one, never part of one.
* :class:`RegularFile` opens a regular file only (``O_NOFOLLOW | O_NONBLOCK``, then
  ``fstat``): a symbolic link as the last component, a FIFO, a device or a directory is
  refused without blocking, and reads never go past the size ``fstat`` gave.

New files get mode ``0o666`` less the umask, as ``open(path, "w")`` gives: a temporary
file is as readable as the file it becomes, and no other user can create one of its names
first (``O_EXCL``).
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import os
import secrets
import stat
from types import TracebackType

from kvcache_core.errors import CacheFileError, CorruptCacheFileError, InvalidArgumentError, InvalidTypeError

__all__ = ["CREATE_ATTEMPTS", "RegularFile", "file_path", "remove_file", "temporary_name", "write_file_atomically"]

#: Mode bits of a new file before the umask, as ``open(path, "w")`` gives.
NEW_FILE_MODE = 0o666
#: Fresh names tried before giving up when each one is taken (by a planted file or link).
CREATE_ATTEMPTS = 16
#: The longest part of the target's name kept in a temporary name (names are <= 255 bytes).
_NAME_PART = 128
#: One ``read`` returns at most about 2 GiB on Linux: larger files are read in chunks.
_READ_CHUNK = 1 << 30

# Platforms without O_NOFOLLOW / O_NONBLOCK (Windows) do without them; fstat still refuses
# whatever is not a regular file.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PLATFORM = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _PLATFORM
_OPEN_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _PLATFORM


def file_path(path: str | os.PathLike[str], *, what: str = "path") -> str:
    """``path`` as a ``str`` naming a file (or a directory); ``what`` names it in errors.

    Raises:
        InvalidTypeError: ``path`` is not a ``str`` or an ``os.PathLike`` giving one.
        InvalidArgumentError: ``path`` is empty or holds a NUL character.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise InvalidTypeError(f"{what} must be a str or os.PathLike of a str, got {type(path).__name__} {path!r}")
    if not text or "\x00" in text:
        raise InvalidArgumentError(f"{what} must be a non-empty str without NUL characters, got {text!r}")
    return text


def temporary_name(name: str) -> str:
    """A fresh name for a temporary file of the file ``name``: hidden, with 64 random bits
    that no other writer (thread, process or user) can predict."""
    return f".{name[:_NAME_PART]}.{secrets.token_hex(8)}.tmp"


def write_file_atomically(path: str, data: bytes, *, what: str) -> int:
    """Make ``path`` a file holding ``data``, atomically: through a temporary file of its
    directory, created exclusively, written, flushed to disk, then renamed over ``path``
    (a symbolic link at ``path`` is replaced, not followed).

    Args:
        path: the file to write.
        data: its whole content.
        what: what the file is, for error messages (``"the prefix cache"``).

    Returns:
        The bytes written.

    Raises:
        CacheFileError: the file cannot be written (no permission, no such directory, a
            directory at ``path``, disk full, every fresh name taken); ``path`` is as it
            was and no temporary file is left.
    """
    directory, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise CacheFileError(errno_codes.EISDIR, f"cannot write {what} to {path!r}: it names a directory, not a file")
    try:
        temporary, descriptor = _create_exclusively(directory, name)
    except OSError as exc:
        raise CacheFileError(exc.errno, f"cannot write {what} to {path!r}: {exc.strerror or exc}") from exc
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise CacheFileError(exc.errno, f"cannot write {what} to {path!r}: {exc.strerror or exc}") from exc
        raise
    _sync_directory(directory)
    return len(data)


def _create_exclusively(directory: str, name: str) -> tuple[str, int]:
    """A new temporary file of ``directory`` for ``name``: ``(its path, a descriptor open
    for writing)``. A name already taken (by anything, a symbolic link included) is never
    opened: another fresh name is drawn."""
    for _ in range(CREATE_ATTEMPTS):
        temporary = os.path.join(directory, temporary_name(name))
        try:
            return temporary, os.open(temporary, _CREATE_FLAGS, NEW_FILE_MODE)
        except FileExistsError:
            continue
    raise FileExistsError(
        errno_codes.EEXIST, f"{CREATE_ATTEMPTS} fresh temporary names in {directory or '.'!r} were all taken"
    )


def _sync_directory(directory: str) -> None:
    """Flush the rename to disk (where the platform can open a directory)."""
    with contextlib.suppress(OSError, AttributeError):
        descriptor = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def remove_file(path: str, *, what: str) -> bool:
    """Remove the file ``path`` (a symbolic link there is removed, not followed).

    Returns:
        Whether there was one.

    Raises:
        CacheFileError: it cannot be removed (no permission, a read-only file system, a
            directory in its place).
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CacheFileError(exc.errno, f"cannot remove {what} {path!r}: {exc.strerror or exc}") from exc
    return True


class RegularFile:
    """A regular file open for reading (a context manager), refused otherwise.

    Args:
        path: the file.
        what: what the file is, for error messages (``"the prefix cache"``).

    Raises:
        CacheFileError: it cannot be opened (no such file, no permission), or is not a
            regular file: a symbolic link (as its last component), a FIFO, a socket, a
            device or a directory. Nothing blocks on a FIFO or reads a device.
    """

    def __init__(self, path: str, *, what: str) -> None:
        self.path = path
        self.what = what
        try:
            descriptor = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if exc.errno == errno_codes.ELOOP:
                reason = "it is a symbolic link (only regular files are read)"
            raise CacheFileError(exc.errno, f"cannot read {what} {path!r}: {reason}") from exc
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                kind = _kind(status.st_mode)
                raise CacheFileError(
                    errno_codes.EISDIR if stat.S_ISDIR(status.st_mode) else errno_codes.EINVAL,
                    f"cannot read {what} {path!r}: it is {kind}, not a regular file",
                )
        except BaseException as exc:
            os.close(descriptor)
            if isinstance(exc, OSError) and not isinstance(exc, CacheFileError):
                raise CacheFileError(exc.errno, f"cannot read {what} {path!r}: {exc.strerror or exc}") from exc
            raise
        self._descriptor = descriptor
        #: Its size in bytes when opened: reads never go past it.
        self.size = status.st_size

    def read_at(self, offset: int, count: int) -> bytes:
        """``count`` bytes from ``offset``.

        Raises:
            CorruptCacheFileError: they lie past the size the file had when opened, or the
                file ends before them (it shrank).
            CacheFileError: the read fails.
        """
        if offset < 0 or count < 0 or offset + count > self.size:
            raise CorruptCacheFileError(
                f"{self.path!r} is truncated: {count} bytes at {offset} were expected, the file has {self.size}"
            )
        if count == 0:
            return b""
        chunks: list[bytes] = []
        done = 0
        try:
            while done < count:
                os.lseek(self._descriptor, offset + done, os.SEEK_SET)
                chunk = os.read(self._descriptor, min(count - done, _READ_CHUNK))
                if not chunk:
                    raise CorruptCacheFileError(
                        f"{self.path!r} is truncated: it ended at {offset + done} bytes while read, "
                        f"{offset + count} were expected"
                    )
                chunks.append(chunk)
                done += len(chunk)
        except OSError as exc:
            raise CacheFileError(exc.errno, f"cannot read {self.what} {self.path!r}: {exc.strerror or exc}") from exc
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        """Close it (again: no effect)."""
        descriptor, self._descriptor = self._descriptor, -1
        if descriptor >= 0:
            os.close(descriptor)

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"
