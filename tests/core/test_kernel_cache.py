"""numba's on-disk cache of the kernel follows every kernel source: an edit of a module the
compiled code is built from, not only of the one defining the function, compiles it again;
the dispatch keys its calibrations by the same stamp."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache_core.attention import _kernel_cache
from kvcache_core.attention.kernel import kernel_available, kernel_sources_stamp

needs_numba = pytest.mark.skipif(not kernel_available(), reason="the kernel's cache is numba's")

#: Plans one small batch with the compiled planner (a cached function defined in
#: ``_plan_jit``) and prints whether numba loaded it from disk.
_PLAN_ONCE = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvcache_core.attention import _kernel_cache, _plan_jit
lengths = np.array([5, 9], dtype=np.int32)
offsets = np.array([0, 1, 2], dtype=np.int32)
_plan_jit.plan_work(lengths, offsets, 2, 1, True, 0, 0, 1, (64, 512, 0.25, 1))
stats = _plan_jit.plan_work.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                  "registered": _kernel_cache.register_locators(), "stamp": _kernel_cache.sources_stamp()}))
"""


def _plan(source: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_ONCE, str(source)], capture_output=True, text=True, timeout=300, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@needs_numba
def test_an_edit_of_another_kernel_module_compiles_the_kernel_again(tmp_path: Path) -> None:
    """The planner is defined in ``_plan_jit``; an edit of ``_kernel_ir`` (which numba's own
    stamp, the defining file's, would not see) makes the next process compile it again."""
    package = Path(_kernel_cache.__file__).parents[1]
    source = tmp_path / "src"
    shutil.copytree(package, source / "kvcache_core", ignore=shutil.ignore_patterns("__pycache__"))
    first = _plan(source)
    assert first["registered"] is True
    assert (first["hits"], first["misses"]) == (0, 1)
    assert _plan(source)["hits"] == 1  # unchanged: loaded from disk

    edited = source / "kvcache_core" / "attention" / "_kernel_ir.py"
    edited.write_text(edited.read_text() + "\n# an edit\n")
    after = _plan(source)
    assert (after["hits"], after["misses"]) == (0, 1)
    assert after["stamp"] != first["stamp"]
    assert _plan(source)["hits"] == 1


def test_the_stamp_covers_every_kernel_module() -> None:
    folder = Path(_kernel_cache.__file__).parent
    assert all((folder / f"{name}.py").is_file() for name in _kernel_cache.KERNEL_MODULES)
    stamp = kernel_sources_stamp()
    assert len(stamp) == 16
    assert int(stamp, 16) >= 0


def test_sources_that_cannot_be_read_give_a_fixed_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel imported from a zip has no files to hash: importing it still works."""

    def refuse(path: Path) -> bytes:
        raise FileNotFoundError(path)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    assert _kernel_cache.sources_stamp.__wrapped__() == "unreadable"


def test_the_torch_dispatch_keys_its_calibrations_by_the_stamp() -> None:
    dispatch = pytest.importorskip("kvcache_torch.dispatch")
    assert dispatch.DISPATCH.libraries["kernel"] == kernel_sources_stamp()
