"""Where the suite's temporary files go: at the everyday size (``tests.sizes``), a folder of
the machine's memory file system (``/dev/shm``) where it has one; at full size (CI) and
wherever ``TMPDIR`` is set, the system's temporary folder as Python chooses it.

pytest's ``tmp_path`` folders and the temporary pools of the memmap backend (a pool made
without a path, as the conformance kit makes them) live there. The memmap backend writes
its pool back to the file (``msync``) at every flush and close; on a virtual disk shared
with other work that wait dominated its tests (the memmap example's tests in one process on
a loaded 2-core machine: 153 s, 24 s of it on the CPU, on the disk; 30 s in memory). The tests, the code they
run and what they assert are the same on either file system; the full-size run keeps the
disk.

A support module, not a test file: it holds no tests.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

#: The memory file system the everyday run puts its temporary files on, where present.
MEMORY_ROOT = Path("/dev/shm")

#: The free space the memory file system must have for the suite to use it.
MIN_FREE_BYTES = 2 << 30


def private_folder(root: Path, uid: int) -> Path | None:
    """``root/kvcache-tests-<uid>``, created (mode 0700) if missing; ``None`` where ``root``
    is not a writable folder with :data:`MIN_FREE_BYTES` free, or the folder is not a plain
    folder that ``uid`` owns and no one else may write (someone else's, or a link)."""
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        return None
    space = os.statvfs(root)
    if space.f_bavail * space.f_frsize < MIN_FREE_BYTES:
        return None
    folder = root / f"kvcache-tests-{uid}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        return None
    return folder


def memory_temp_folder(environ: Mapping[str, str], *, full: bool, root: Path = MEMORY_ROOT) -> Path | None:
    """The folder the run's temporary files go to, or ``None`` for the system's choice: an
    everyday run (``full`` false) where ``environ`` sets no ``TMPDIR`` and ``root`` is usable
    (:func:`private_folder`)."""
    getuid = getattr(os, "getuid", None)  # POSIX only
    if full or environ.get("TMPDIR") or getuid is None:
        return None
    return private_folder(root, getuid())


def use_memory_temp_folder(environ: MutableMapping[str, str], *, full: bool, root: Path = MEMORY_ROOT) -> Path | None:
    """Send this process's temporary files, and those of the processes it starts (through
    ``TMPDIR`` in ``environ``), to :func:`memory_temp_folder`; returns it (``None``: nothing
    changed)."""
    folder = memory_temp_folder(environ, full=full, root=root)
    if folder is not None:
        environ["TMPDIR"] = str(folder)
        tempfile.tempdir = str(folder)
    return folder
