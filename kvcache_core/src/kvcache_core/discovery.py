"""Finding backends: entry points of group ``kvcache_core.backends``, loaded through pluggy.

Each entry point is loaded and asked for its specs on its own: a plugin that fails to
import, or whose hook raises, produces a :class:`~kvcache_core.errors.KvCachePluginWarning`
naming its distribution, and every other backend still loads. Discovery runs once and is
cached; :func:`refresh_backends` runs it again (after installing a plugin at run time).

Discovery imports the plugin modules only; they must not import torch or jax at module
level, so listing backends never does.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal, overload

import pluggy

from kvcache_core.backends.layered import LayeredStorage
from kvcache_core.backends.numpy import NumpyArray
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, STATE_LAYERS, BackendHookSpecs, BackendSpec
from kvcache_core.contract.protocols import KvStorage
from kvcache_core.errors import (
    BackendConflictError,
    BackendNotFoundError,
    BackendUnavailableError,
    InvalidTypeError,
    KvCachePluginWarning,
    UnsupportedConfigError,
)
from kvcache_core.manager import PagedKvCacheManager
from kvcache_core.offload.tiers import OffloadTier
from kvcache_core.paging.allocator import Placement

if TYPE_CHECKING:  # the array types of the built-in backends, for create_manager's overloads only
    import jax
    import torch

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "BackendInfo",
    "available_backends",
    "create_manager",
    "get_backend",
    "get_plugin_manager",
    "installed_backends",
    "refresh_backends",
]

#: Backends this project publishes, with the command that installs each.
KNOWN_BACKENDS: dict[str, str] = {
    "numpy": "pip install kvcache-core",
    "torch": "pip install kvcache-torch",
    "jax": "pip install kvcache-jax",
}


@dataclass(frozen=True)
class BackendInfo:
    """An installed backend: its spec and where it came from."""

    spec: BackendSpec[Any]
    distribution: str
    version: str
    entry_point: str

    @property
    def name(self) -> str:
        """The backend's name."""
        return self.spec.name


@dataclass(frozen=True)
class _Registry:
    plugin_manager: pluggy.PluginManager
    backends: dict[str, BackendInfo]
    conflicts: dict[str, tuple[str, ...]]


_lock = threading.Lock()
_registry: _Registry | None = None

#: What a storage factory's result must have (the members of :class:`KvStorage`).
_STORAGE_MEMBERS = tuple(name for name in vars(KvStorage) if not name.startswith("_"))


def _distribution_of(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    dist = entry_point.dist
    if dist is None:
        return "unknown distribution", "?"
    return dist.metadata["Name"] or "unknown distribution", dist.version


def _collect_specs(plugin_manager: pluggy.PluginManager, plugin: object) -> list[BackendSpec[Any]]:
    """Call this plugin's hook implementations alone, so a failure stays its own."""
    impls = [impl for impl in plugin_manager.hook.kvcache_register_backends.get_hookimpls() if impl.plugin is plugin]
    if not impls:
        raise TypeError("it defines no @hookimpl kvcache_register_backends()")
    specs: list[BackendSpec[Any]] = []
    for impl in impls:
        produced: object = impl.function()
        if produced is None:
            continue
        if not isinstance(produced, Iterable):
            raise TypeError(f"its hook returned {type(produced).__name__}, not an iterable of BackendSpec")
        items: Iterable[object] = produced  # pyright: ignore[reportUnknownVariableType]
        for item in items:
            if not isinstance(item, BackendSpec):
                raise TypeError(f"its hook yielded {type(item).__name__}, not BackendSpec")
            specs.append(item)  # pyright: ignore[reportUnknownArgumentType]
    return specs


def _discover() -> _Registry:
    plugin_manager = pluggy.PluginManager(PROJECT_NAME)
    plugin_manager.add_hookspecs(BackendHookSpecs)
    backends: dict[str, BackendInfo] = {}
    conflicts: dict[str, list[str]] = {}
    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))
    for entry_point in entry_points:
        distribution, version = _distribution_of(entry_point)
        try:
            plugin = entry_point.load()
            if plugin_manager.is_registered(plugin):
                continue  # two entry points naming one module: already counted
            plugin_manager.register(plugin, name=f"{distribution}:{entry_point.name}")
            try:
                specs = _collect_specs(plugin_manager, plugin)
            except (Exception, SystemExit):
                plugin_manager.unregister(plugin)
                raise
        # Isolate every plugin: one broken one (even one calling sys.exit on import) must
        # hide nothing. KeyboardInterrupt still stops the program.
        except (Exception, SystemExit) as exc:
            warnings.warn(
                KvCachePluginWarning(
                    f"kvcache backend plugin {entry_point.name!r} from distribution {distribution} "
                    f"{version} ({entry_point.value}) failed to load and was skipped: "
                    f"{type(exc).__name__}: {exc}"
                ),
                stacklevel=3,
            )
            continue
        for spec in specs:
            info = BackendInfo(spec, distribution, version, f"{entry_point.name} = {entry_point.value}")
            if spec.name in backends and backends[spec.name].distribution != distribution:
                conflicts.setdefault(spec.name, [backends[spec.name].distribution]).append(distribution)
                warnings.warn(
                    KvCachePluginWarning(
                        f"kvcache backend {spec.name!r} is registered by both "
                        f"{backends[spec.name].distribution} and {distribution}; using it raises "
                        "until one is uninstalled"
                    ),
                    stacklevel=3,
                )
                continue
            backends.setdefault(spec.name, info)
    return _Registry(plugin_manager, backends, {k: tuple(v) for k, v in conflicts.items()})


def _get_registry() -> _Registry:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _discover()
        return _registry


def refresh_backends() -> None:
    """Forget the cached discovery; the next call looks at the entry points again."""
    global _registry
    with _lock:
        _registry = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy plugin manager holding every loaded backend plugin."""
    return _get_registry().plugin_manager


def installed_backends() -> list[BackendInfo]:
    """Every backend whose plugin loaded, available here or not, sorted by name."""
    registry = _get_registry()
    return [registry.backends[name] for name in sorted(registry.backends)]


def available_backends() -> list[str]:
    """Names of the installed backends that can run here, sorted."""
    return [info.name for info in installed_backends() if info.spec.availability()[0]]


def _install_hint(names: Iterable[str]) -> str:
    hints = [f"{name}: {KNOWN_BACKENDS[name]}" for name in KNOWN_BACKENDS if name not in names]
    return "; to add more: " + ", ".join(hints) if hints else ""


def get_backend(name: str) -> BackendSpec[Any]:
    """The spec of an installed, available backend.

    Raises:
        BackendNotFoundError: no installed backend has this name (the message lists the
            installed ones and how to install the known others).
        BackendConflictError: two distributions register this name.
        BackendUnavailableError: installed, but cannot run here (the message says why).
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"backend name must be a str, got {name!r}")
    registry = _get_registry()
    if name in registry.conflicts:
        raise BackendConflictError(
            f"backend {name!r} is registered by several distributions: "
            f"{', '.join(registry.conflicts[name])}; uninstall all but one"
        )
    info = registry.backends.get(name)
    if info is None:
        installed = sorted(registry.backends)
        hint = f" (install it with: {KNOWN_BACKENDS[name]})" if name in KNOWN_BACKENDS else ""
        raise BackendNotFoundError(
            f"no kvcache backend named {name!r}{hint}; installed: {', '.join(installed) or 'none'}"
            f"{_install_hint(installed)}"
        )
    available, reason = info.spec.availability()
    if not available:
        raise BackendUnavailableError(f"kvcache backend {name!r} ({info.distribution}) is unavailable: {reason}")
    return info.spec


@overload
def create_manager(
    backend: Literal["numpy"],
    config: CacheConfig,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    **options: Any,
) -> PagedKvCacheManager[NumpyArray]: ...
@overload
def create_manager(
    backend: Literal["torch"],
    config: CacheConfig,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    **options: Any,
) -> PagedKvCacheManager[torch.Tensor]: ...
@overload
def create_manager(
    backend: Literal["jax"],
    config: CacheConfig,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    **options: Any,
) -> PagedKvCacheManager[jax.Array]: ...
@overload
def create_manager(
    backend: str,
    config: CacheConfig,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    **options: Any,
) -> PagedKvCacheManager[Any]: ...
def create_manager(
    backend: str,
    config: CacheConfig,
    *,
    placement: Placement = "contiguous",
    tiers: Sequence[OffloadTier] = (),
    **options: Any,
) -> PagedKvCacheManager[Any]:
    """A paged cache manager over a new pool of the named backend.

    Typed with the backend's array type for the built-in backends (``"numpy"`` ->
    ``numpy.ndarray``, ``"torch"`` -> ``torch.Tensor``, ``"jax"`` -> ``jax.Array``), so
    ``manager.allocate(request).key_cache(0)`` is a ``torch.Tensor | None`` to a type
    checker; ``Any`` for other names. Close it (``manager.close()`` or ``with``) to
    release the pool at once.

    Args:
        backend: an installed backend's name (``"numpy"``, ``"torch"``, ``"jax"``, ...).
        config: the pool's configuration.
        placement: the allocator's placement policy (see :class:`BlockAllocator`).
        tiers: offload tiers behind the pool, fastest first, a list or tuple of
            :class:`~kvcache_core.offload.tiers.OffloadTier` (:class:`~kvcache_core.offload.tiers.HostTier`,
            :class:`~kvcache_core.offload.tiers.DiskTier`, ...; see :mod:`kvcache_core.offload.tiers`).
        **options: passed to the backend's storage factory (backend-specific).

    Every argument is checked before the pool is made; if the manager cannot be built on
    it (a tier that cannot bind, a bad ``placement``), the pool is closed again.

    Raises:
        BackendNotFoundError, BackendConflictError, BackendUnavailableError: see
            :func:`get_backend`.
        InvalidTypeError: ``config`` is not a :class:`CacheConfig`, or ``tiers`` is not a
            list or tuple of ``OffloadTier`` (a single tier included).
        UnsupportedConfigError: the backend does not support the config's dtype, device
            or layout (the message lists what it supports), recurrent-state layers (it does
            not claim ``"state_layers"``), an option its storage factory
            does not take, or a policy not built yet.
        BackendUnavailableError: the backend is broken: its storage factory is not
            callable or returned something that is not a storage.
    """
    spec = get_backend(backend)
    if not isinstance(config, CacheConfig):
        raise InvalidTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
    _check_tiers(tiers)
    config = spec.resolve(config)  # kv_layout=None: the backend's fastest layout
    storage_config = config.storage_config()  # with KV-cache groups: one group's layers
    problems = spec.check_config(storage_config)
    if config.states.arrays and STATE_LAYERS not in spec.capabilities:
        problems.append(f"recurrent-state layers (LayerSpec(state=...): capability {STATE_LAYERS!r} not claimed)")
    if problems:
        raise UnsupportedConfigError(f"backend {backend!r} does not support {'; '.join(problems)}")
    if not callable(spec.storage_factory):
        raise BackendUnavailableError(
            f"backend {backend!r} is broken: its storage_factory {spec.storage_factory!r} is not callable"
        )
    try:
        signature = inspect.signature(spec.storage_factory)
    except (TypeError, ValueError):
        signature = None  # a callable without a signature (a builtin): let the call decide
    if signature is not None:
        try:
            signature.bind(storage_config, **options)
        except TypeError as exc:
            raise UnsupportedConfigError(
                f"backend {backend!r} does not take the options {sorted(options)}: {exc}"
            ) from exc
    storage: Any
    if storage_config.mixed_geometry:  # one part per geometry of the layers (capability checked above)
        layers = config.storage_layers
        storage = LayeredStorage(
            storage_config, spec.storage_factory, pages=layers.pages, offsets=layers.offsets, **options
        )
    else:
        storage = spec.storage_factory(storage_config, **options)
    missing = [name for name in _STORAGE_MEMBERS if not hasattr(storage, name)]
    if missing:
        raise BackendUnavailableError(
            f"backend {backend!r} is broken: its storage_factory returned {type(storage).__name__}, "
            f"which lacks the KvStorage members {missing}"
        )
    extra: dict[str, Any] = {"tiers": tiers} if tiers else {}  # a custom manager factory may predate tiers
    if storage_config is not config:
        extra["config"] = config  # the manager maps the model's layers onto the storage's
    manager: PagedKvCacheManager[Any]
    try:
        if spec.manager_factory is not None:
            made = spec.manager_factory(storage, backend=spec.name, placement=placement, **extra)
            if not isinstance(made, PagedKvCacheManager):
                raise InvalidTypeError(
                    f"backend {spec.name!r}: manager_factory must return a PagedKvCacheManager "
                    f"(or a subclass), got {type(made).__name__}"
                )
            manager = made
        else:
            manager = PagedKvCacheManager[Any](storage, backend=spec.name, placement=placement, **extra)
    except BaseException:
        close = getattr(storage, "close", None)  # the pool is nobody's: release it now
        if callable(close):
            with contextlib.suppress(Exception):  # the manager's error is the one to report
                close()
        raise
    return manager


def _check_tiers(tiers: object) -> None:
    """Refuse ``tiers`` that are not a list or tuple, before the pool is made. Each tier is
    checked by the tier stack as it binds it (a tier whose members fail to read is a
    ``TierError`` there, not an exception of its own).

    Raises:
        InvalidTypeError: naming the value.
    """
    if not isinstance(tiers, (list, tuple)):
        raise InvalidTypeError(
            f"tiers must be a list or tuple of OffloadTier (HostTier, DiskTier, ...), got {tiers!r}; "
            "pass one tier as [tier]"
        )
