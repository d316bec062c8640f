"""The repository keeps its promises: README commands, CI script and examples agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("kvcache demo")
    assert commands[1].endswith("python -m pytest")
    assert all("-c constraints.txt" in command for command in commands)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in script.splitlines()


def test_constraints_pin_torch_to_the_local_cpu_wheel() -> None:
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().splitlines()


def test_readme_example_is_the_quickstart_script() -> None:
    text = (ROOT / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)[0]
    script = (ROOT / "examples" / "quickstart.py").read_text()
    assert example.strip() in script.replace("from __future__ import annotations\n\n", "")
    assert len(example.strip().splitlines()) <= 20


def test_examples_run() -> None:
    for script in sorted((ROOT / "examples").glob("*.py")):
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_readme_shows_how_to_write_register_and_check_a_backend_in_under_40_lines() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Writing a backend", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 4  # entry point, storage + hook, test file, commands
    assert sum(len(block.strip().splitlines()) for block in blocks) < 40
    kit_file = (ROOT / "examples" / "kvcache-memmap" / "tests" / "test_conformance.py").read_text()
    code = [line for line in blocks[2].splitlines() if line.strip() and not line.startswith("#")]
    assert code == [line for line in kit_file.splitlines() if line.strip() and not line.startswith('"""')]
    pyproject = (ROOT / "examples" / "kvcache-memmap" / "pyproject.toml").read_text()
    assert 'memmap = "kvcache_memmap"' in pyproject


def test_readme_shows_the_transformers_drop_in_in_under_15_lines() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(snippet.strip().splitlines()) < 15
    assert "cache=cache" in snippet
    assert 'attn_implementation="kvcache_paged"' in snippet


#: Where integrations live: they may use core's public API only (core owns every policy).
INTEGRATIONS = ("kvcache_torch/src", "kvcache_jax/src", "examples", "benchmarks")
#: Reaching into a manager: its storage, allocator or prefix map, or any private member.
MANAGER_INTERNALS = re.compile(r"(?:\b|_)manager\.(?:storage|allocator|prefix_cache)\b|(?:\b|_)manager\._[a-z]\w*")


def test_integrations_use_no_manager_internals() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in INTEGRATIONS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if MANAGER_INTERNALS.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == [], "use core's public API (the step, fork, truncate, gather, stats):\n" + "\n".join(offenders)


def test_the_internals_check_finds_what_it_looks_for() -> None:
    for line in ("m = self._manager.storage", "free = manager.allocator.free_block_count()", "manager._requests"):
        assert MANAGER_INTERNALS.search(line), line
    for line in ("manager.stats().free_blocks", "manager.begin_step(handles, 1)", "storage.write(0, slots, k, v)"):
        assert not MANAGER_INTERNALS.search(line), line


#: Modules of kvcache_core may not grow past this many lines: split along a seam instead.
MODULE_LINE_LIMIT = 600


def test_no_core_module_outgrows_the_limit() -> None:
    package = ROOT / "kvcache_core" / "src" / "kvcache_core"
    sizes = {path.relative_to(package).as_posix(): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    assert len(sizes) > 30, "the package was not found"
    over = {name: lines for name, lines in sizes.items() if lines > MODULE_LINE_LIMIT}
    assert over == {}, f"split these along their seams (limit {MODULE_LINE_LIMIT} lines): {over}"


def test_the_top_level_names_are_the_public_api_only() -> None:
    import kvcache_core

    internals = {"BlockAllocator", "FreeBlockQueue", "BlockEvictor", "PrefixCache", "hash_block", "get_plugin_manager"}
    internals |= {
        "hookspec",
        "BlockPool",
        "PrefixChains",
        "SequenceBlocks",
        "ArgumentChecks",
        "PoolAccess",
        "TierChain",
    }
    assert internals.isdisjoint(kvcache_core.__all__), sorted(internals & set(kvcache_core.__all__))
    assert all(hasattr(kvcache_core, name) for name in kvcache_core.__all__)
    for name in ("CacheConfig", "create_manager", "PagedKvCacheManager", "Step", "BackendSpec", "KvCacheError"):
        assert name in kvcache_core.__all__, name
