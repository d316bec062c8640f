"""Backend discovery through real entry points of fake distributions put on ``sys.path``."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_core import CacheConfig, UnsupportedConfigError, available_backends, create_manager
from kvcache_core.cli import main
from kvcache_core.discovery import KNOWN_BACKENDS, get_backend, get_plugin_manager, installed_backends, refresh_backends
from kvcache_core.errors import BackendConflictError, BackendNotFoundError, BackendUnavailableError
from kvcache_core.plugin import KvCachePluginWarning
from kvcache_core.testing import inspect
from tests.process_support import run_python

AddDistribution = Callable[[Path, str, str, str, str, str], None]

GOOD_PLUGIN = """
from kvcache_core.plugin import BackendSpec, hookimpl
from kvcache_core.backends.numpy import NumpyStorage

class FakeStorage(NumpyStorage):
    pass

@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="{name}", storage_factory=FakeStorage, dtypes=("float32",),
                      description="a second backend for the tests")
"""

UNAVAILABLE_PLUGIN = """
from kvcache_core.plugin import BackendSpec, hookimpl

@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="ghost", storage_factory=object, is_available=lambda: False,
                      unavailable_reason=lambda: "no ghost device here", devices=("cuda",))
"""

IMPORT_ERROR_PLUGIN = "import a_module_that_does_not_exist_anywhere\n"

HOOK_ERROR_PLUGIN = """
from kvcache_core.plugin import hookimpl

@hookimpl
def kvcache_register_backends():
    raise RuntimeError("the hook itself is broken")
    yield
"""


def load_quietly() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KvCachePluginWarning)
        return [info.name for info in installed_backends()]


def test_numpy_is_registered_through_the_entry_point_of_kvcache_core() -> None:
    refresh_backends()
    info = {i.name: i for i in installed_backends()}["numpy"]
    assert info.distribution == "kvcache-core"
    assert info.entry_point == "numpy = kvcache_core.backends.numpy"
    assert "numpy" in available_backends()
    assert any(name.endswith(":numpy") for name, _ in get_plugin_manager().list_name_plugin())


def test_a_second_backend_is_found_and_usable(plugin_dir: Path, add_distribution: AddDistribution) -> None:
    add_distribution(plugin_dir, "kvtest-fake", "1.2.3", "fake", "kvtest_fake", GOOD_PLUGIN.format(name="fake"))
    infos = {i.name: i for i in installed_backends()}
    assert set(infos) >= {"numpy", "fake"}
    assert (infos["fake"].distribution, infos["fake"].version) == ("kvtest-fake", "1.2.3")
    manager = create_manager("fake", CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4))
    assert type(manager.storage).__name__ == "FakeStorage"
    assert manager.backend == "fake"


def test_a_plugin_that_fails_to_import_warns_with_its_distribution_and_hides_nothing(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-broken", "0.1", "broken", "kvtest_broken", IMPORT_ERROR_PLUGIN)
    add_distribution(plugin_dir, "kvtest-fake", "1.0", "fake", "kvtest_fake", GOOD_PLUGIN.format(name="fake"))
    with pytest.warns(
        KvCachePluginWarning, match=r"'broken' from distribution kvtest-broken 0\.1.*ModuleNotFoundError"
    ):
        names = [info.name for info in installed_backends()]
    assert "broken" not in names
    assert {"numpy", "fake"} <= set(names)
    assert get_backend("fake").name == "fake"


def test_a_plugin_whose_hook_raises_warns_and_hides_nothing(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    baseline = load_quietly()
    add_distribution(plugin_dir, "kvtest-hookfail", "2.0", "hookfail", "kvtest_hookfail", HOOK_ERROR_PLUGIN)
    refresh_backends()
    with pytest.warns(KvCachePluginWarning, match="kvtest-hookfail.*the hook itself is broken"):
        names = [info.name for info in installed_backends()]
    assert names == baseline
    assert "numpy" in names
    assert not get_plugin_manager().has_plugin("kvtest-hookfail:hookfail")


def test_an_unavailable_backend_is_listed_with_its_reason_and_refused(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-ghost", "0.3", "ghost", "kvtest_ghost", UNAVAILABLE_PLUGIN)
    assert "ghost" in load_quietly()
    assert "ghost" not in available_backends()
    with pytest.raises(BackendUnavailableError, match=r"'ghost' .*no ghost device here"):
        create_manager("ghost", CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4))
    out = io.StringIO()
    assert main(["backends"], out) == 0
    assert "no: no ghost device here" in out.getvalue()


def test_two_distributions_claiming_one_name_warn_and_using_it_raises(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-one", "1.0", "dup", "kvtest_one", GOOD_PLUGIN.format(name="dup"))
    add_distribution(plugin_dir, "kvtest-two", "1.0", "dup", "kvtest_two", GOOD_PLUGIN.format(name="dup"))
    with pytest.warns(KvCachePluginWarning, match="'dup' is registered by both"):
        installed_backends()
    with pytest.raises(BackendConflictError, match="kvtest-one, kvtest-two"):
        get_backend("dup")
    assert get_backend("numpy").name == "numpy"


@pytest.fixture
def ghost_known(monkeypatch: pytest.MonkeyPatch) -> str:
    """A known backend that is certainly not installed (torch and jax may well be)."""
    monkeypatch.setitem(KNOWN_BACKENDS, "ghostlib", "pip install kvcache-ghostlib")
    refresh_backends()
    return "ghostlib"


def test_an_unknown_backend_lists_what_is_installed_and_how_to_get_more(ghost_known: str) -> None:
    installed = ", ".join(sorted(load_quietly()))
    with pytest.raises(BackendNotFoundError, match=rf"'nope'.*installed: {installed}.*pip install kvcache-ghostlib"):
        get_backend("nope")


def test_a_known_but_missing_backend_says_how_to_install_it(ghost_known: str) -> None:
    with pytest.raises(BackendNotFoundError, match=r"install it with: pip install kvcache-ghostlib"):
        create_manager(ghost_known, CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4))


def test_a_config_the_backend_does_not_support_is_refused_with_what_it_supports() -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4, dtype="bfloat16", device="cuda:0")
    with pytest.raises(
        UnsupportedConfigError,
        match=r"dtype 'bfloat16' \(supported: float16, float32, float64, int8, float8_e4m3fn\).*"
        r"device 'cuda:0'",
    ):
        create_manager("numpy", config)


def test_backends_command_lists_numpy_with_its_distribution() -> None:
    refresh_backends()
    out = io.StringIO()
    assert main(["backends"], out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["name", "distribution", "version", "available", "devices", "description"]
    numpy_row = next(line.split() for line in lines if line.startswith("numpy"))
    assert numpy_row[1] == "kvcache-core"
    assert numpy_row[3] == "yes"


def test_importing_and_listing_never_imports_torch_or_jax(tmp_path: Path) -> None:
    """Poisoned torch and jax packages on the path: any import of them fails the run."""
    for name in ("torch", "jax", "jaxlib"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('{name} was imported')\n")
    code = (
        "import sys, kvcache_core\n"
        "kvcache_core.installed_backends(); kvcache_core.available_backends()\n"
        "kvcache_core.get_backend('numpy')\n"
        "assert not {'torch', 'jax'} & set(sys.modules), sorted(sys.modules)\n"
        "print('clean')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_python("-c", code, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_an_option_the_storage_does_not_take_is_refused_by_name() -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4)
    with pytest.raises(UnsupportedConfigError, match=r"does not take the options \['mesh'\]"):
        create_manager("numpy", config, mesh="8 devices")


def test_the_placement_policy_is_chosen_at_creation() -> None:
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=4)
    assert inspect.allocator(create_manager("numpy", config)).placement == "contiguous"
    assert inspect.allocator(create_manager("numpy", config, placement="fifo")).placement == "fifo"


EXIT_PLUGIN = "import sys\nsys.exit(3)\n"

WRONG_FACTORY_PLUGIN = """
from kvcache_core.plugin import BackendSpec, hookimpl

@hookimpl
def kvcache_register_backends():
    yield BackendSpec(name="wrongtype", storage_factory=lambda config: 42, dtypes=("float32",))
    yield BackendSpec(name="notcallable", storage_factory=42, dtypes=("float32",))
"""


def test_a_plugin_that_calls_sys_exit_on_import_warns_and_hides_nothing(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-exit", "0.2", "exiting", "kvtest_exit", EXIT_PLUGIN)
    refresh_backends()
    with pytest.warns(KvCachePluginWarning, match=r"'exiting' from distribution kvtest-exit 0\.2.*SystemExit"):
        names = [info.name for info in installed_backends()]
    assert "exiting" not in names
    assert create_manager("numpy", CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=2)).backend == "numpy"


def test_a_storage_factory_of_the_wrong_type_is_named_as_broken(
    plugin_dir: Path, add_distribution: AddDistribution
) -> None:
    add_distribution(plugin_dir, "kvtest-wrong", "0.1", "wrong", "kvtest_wrong", WRONG_FACTORY_PLUGIN)
    refresh_backends()
    config = CacheConfig(num_layers=1, num_heads=1, head_dim=2, num_blocks=2)
    with pytest.raises(BackendUnavailableError, match=r"'wrongtype' is broken.*returned int.*lacks.*'write'"):
        create_manager("wrongtype", config)
    with pytest.raises(BackendUnavailableError, match=r"'notcallable' is broken.*not callable"):
        create_manager("notcallable", config)


def test_the_capability_vocabulary_is_one_list() -> None:
    from kvcache_core.backends.numpy import ATTENTION_CAPABILITIES, POLICY_CAPABILITIES
    from kvcache_core.contract.hookspecs import CAPABILITIES
    from kvcache_core.testing._plugin import POLICY_CAPABILITIES as KIT_POLICIES
    from kvcache_core.testing.backend import CAPABILITIES as KIT_CAPABILITIES

    assert set(KIT_POLICIES) == set(POLICY_CAPABILITIES)
    assert (
        KIT_CAPABILITIES
        == set(CAPABILITIES)
        == POLICY_CAPABILITIES
        | ATTENTION_CAPABILITIES
        | {"immutable_arrays", "layer_geometry", "memory_regions", "state_layers", "step_lanes", "value_head_dim"}
    )
