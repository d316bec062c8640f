"""``kvcache dispatch``: the attention path each shape class runs on this machine, as the
backends measured and kept them (:mod:`kvcache_core.backends.dispatch`): one file per
backend, machine and versions, each listed with the machine and versions it was measured
under; ``--forget`` removes the files, so the next run measures again."""

from __future__ import annotations

import argparse
from typing import TextIO

from kvcache_core._table import write_table
from kvcache_core.backends.dispatch import (
    CACHE_DIR_ENV,
    cache_directory,
    dispatch_file_backend,
    machine_key,
    read_dispatch_file,
)
from kvcache_core.errors import CacheFileError, CorruptCacheFileError
from kvcache_core.offload.safe_files import remove_file

__all__ = ["run_dispatch"]


def run_dispatch(args: argparse.Namespace, out: TextIO) -> int:
    """Print (or with ``args.forget`` remove) the calibration files; the exit status."""
    directory = cache_directory()
    if directory is None:
        out.write(f"{CACHE_DIR_ENV}=off: choices are measured in each process and kept in memory only\n")
        return 0
    found = directory.glob("dispatch-*.json") if directory.is_dir() else ()
    files = sorted(path for path in found if dispatch_file_backend(path.name))
    if not files:
        out.write(f"no attention dispatch file in {directory}: each shape class is measured at its first call\n")
        return 0
    here = machine_key({})
    status = 0
    for path in files:
        backend = dispatch_file_backend(path.name)
        if args.forget:
            remove_file(str(path), what="the attention dispatch file")
            out.write(f"{backend}: removed {path}\n")
            continue
        try:
            machine, choices = read_dispatch_file(path)
        except (CacheFileError, CorruptCacheFileError) as exc:
            out.write(f"{backend}: {path} is unusable (it is ignored): {exc}\n")
            status = 1
            continue
        same = all(machine.get(name) == value for name, value in here.items())
        versions = ", ".join(f"{name} {value}" for name, value in machine.items() if name not in here)
        out.write(
            f"{backend}: {path} ({'this machine' if same else 'another machine: not used here'}: {machine.get('cpu')}, "
            f"{machine.get('cores')} cores; {versions})\n"
        )
        rows = [
            [
                key,
                choice.path,
                *(f"{choice.seconds.get(name, float('nan')) * 1e6:.0f}" for name in ("kernel", "native")),
            ]
            for key, choice in sorted(choices.items())
        ]
        write_table(["shape class", "path", "kernel us", "native us"], rows, out)
    return status
