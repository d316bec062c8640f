"""The repository keeps its promises: README commands, CI script and examples agree."""

from __future__ import annotations

import ast
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
#: The manager is the users' facade: one documented method per operation, each delegating to
#: the part that owns it (ARCHITECTURE.md); its length is its docstrings, not its logic.
FACADE_LINE_LIMITS = {"kvcache_core/manager.py": 700}


def test_no_module_of_any_distribution_outgrows_the_limit() -> None:
    sources = [ROOT / name / "src" for name in ("kvcache_core", "kvcache_torch", "kvcache_jax")]
    sizes = {
        path.relative_to(source).as_posix(): len(path.read_text().splitlines())
        for source in sources
        for path in source.rglob("*.py")
    }
    assert len(sizes) > 60, "the packages were not found"
    over = {name: lines for name, lines in sizes.items() if lines > FACADE_LINE_LIMITS.get(name, MODULE_LINE_LIMIT)}
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
    for name in ("CacheConfig", "create_manager", "PagedKvCacheManager", "Step", "KvCacheError"):
        assert name in kvcache_core.__all__, name
    import kvcache_core.plugin

    for name in ("BackendSpec", "hookimpl", "KvStorage", "CAPABILITIES", "KV_LAYOUTS"):
        assert name in kvcache_core.plugin.__all__, name


#: The folders of the repository's tests (each a tree of test files, support modules and conftests).
TEST_FOLDERS = ("tests", "examples/kvcache-memmap/tests")


def is_test_module(name: str) -> bool:
    """Whether the dotted module ``name`` is a test file or a conftest (not a support module)."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, relative imports resolved
    (``from a import b`` counts ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def imports_of_test_modules(source: str, package: str) -> list[str]:
    """The test files and conftests ``source`` (a module of ``package``) imports: tests
    share helpers through support modules, never through these."""
    return sorted(name for name in imported_modules(source, package) if is_test_module(name))


def python_files_of_the_tests() -> list[Path]:
    return sorted(path for folder in TEST_FOLDERS for path in (ROOT / folder).rglob("*.py"))


def test_no_test_module_imports_another_test_module() -> None:
    files = python_files_of_the_tests()
    assert len(files) > 50, "the tests were not found"
    offenders = [
        f"{path.relative_to(ROOT)}: imports {name}"
        for path in files
        for name in imports_of_test_modules(
            path.read_text(encoding="utf-8"), ".".join(path.relative_to(ROOT).parent.parts)
        )
    ]
    assert offenders == [], "move shared helpers into a support module (tests/core/support.py):\n" + "\n".join(
        offenders
    )


def test_the_test_import_check_finds_what_it_looks_for() -> None:
    for source in (
        "from tests.core.test_prefix_caching import admit",
        "import tests.core.test_tiers",
        "from tests.core import test_tiers",
        "from .test_tiers import tiered",
        "from . import test_tiers",
        "from tests.torch.conftest import fill",
        "def helper() -> None:\n    from tests.core.test_tiers import tiered",
    ):
        assert imports_of_test_modules(source, "tests.core"), source
    for source in (
        "from tests.core.support import admit, make_manager",
        "from tests.core import support",
        "from .support import admit",
        "from tests.torch.hf_support import model_pair",
        "from kvcache_core.testing import kv_data",
        "import pytest",
    ):
        assert not imports_of_test_modules(source, "tests.core"), source


def test_support_modules_hold_no_tests() -> None:
    files = {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in python_files_of_the_tests()}
    imported = {
        name
        for module, path in files.items()
        for name in imported_modules(path.read_text(encoding="utf-8"), module.rpartition(".")[0])
    }
    support = {module: path for module, path in files.items() if module in imported}
    assert "tests.core.support" in support, sorted(support)
    offenders = [
        f"{path.relative_to(ROOT)}: {node.name}"
        for path in support.values()
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and (node.name.startswith("test_") or node.name.startswith("Test"))
    ]
    assert offenders == [], (
        "a module that tests import holds no tests (pytest would collect them twice):\n" + "\n".join(offenders)
    )
