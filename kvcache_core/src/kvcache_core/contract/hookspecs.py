"""The plugin contract: pluggy markers of project ``"kvcache"``, the hook, and :class:`BackendSpec`.

A backend distribution registers a module under the entry-point group
``kvcache_core.backends`` (the entry point's name is the backend's name) whose hook
yields its spec::

    from kvcache_core.plugin import BackendSpec, hookimpl

    from collections.abc import Iterator

    from kvcache_core.plugin import BackendSpec, hookimpl

    @hookimpl
    def kvcache_register_backends() -> Iterator[BackendSpec[MyArray]]:
        yield BackendSpec(name="mine", storage_factory=MyStorage, dtypes=("float32",))

``BackendSpec`` is generic in the backend's array type and ``storage_factory`` must
return a :class:`~kvcache_core.KvStorage` of it, so mypy and pyright reject a storage
that does not conform (a missing member, a wrong signature or return type) at the line
that registers it, naming the member.

Nothing heavy may be imported at module level of that module: discovery imports it to
list backends. Import the array library inside ``storage_factory`` and ``is_available``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import pluggy

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.states import STATE_LAYERS
from kvcache_core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvcache_core.contract.protocols import KvCacheManager, KvStorage

__all__ = [
    "ATTENTION_CAPABILITIES",
    "CAPABILITIES",
    "ENTRY_POINT_GROUP",
    "IMMUTABLE_ARRAYS",
    "LAYER_GEOMETRY",
    "POLICY_CAPABILITIES",
    "PROJECT_NAME",
    "STATE_LAYERS",
    "VALUE_HEAD_DIM",
    "BackendHookSpecs",
    "BackendSpec",
    "hookimpl",
    "hookspec",
]

ArrayT = TypeVar("ArrayT")

#: The pluggy project name.
PROJECT_NAME = "kvcache"

#: The entry-point group backends register under.
ENTRY_POINT_GROUP = "kvcache_core.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


#: The capability vocabulary of ``BackendSpec.capabilities``: what each one means, and the
#: storage methods it relies on. The policies live in core, but they move bytes only
#: through the storage, so a backend claims one once its storage serves it (the kit then
#: runs that policy's tests against it; unclaimed ones are skipped and listed).
CAPABILITIES: dict[str, str] = {
    "fork": "fork with copy-on-write: the first write into a shared block copies it (copy_blocks)",
    "prefix_caching": "cached full blocks are mapped into new requests, never rewritten (copy_blocks, write, gather)",
    "swap": "swap_out / swap_in move a request's blocks to host memory and back, bit-identical "
    "(blocks_to_host, blocks_from_host)",
    "eviction": "a full pool evicts unreferenced cached blocks before failing (copy_blocks, write)",
    "sliding_window": "blocks outside a sliding window are released; attention masks the rest "
    "(paged_attention with page_table.sliding_window)",
    "attention_window": "paged_attention(window=W) applies a per-call (per-layer) sliding window, combined with "
    "the page table's (storage.attention_features lists it)",
    "softcap": "paged_attention(softcap=cap) caps the scaled scores as tanh(s / cap) * cap before the mask "
    "(storage.attention_features lists it)",
    "sinks": "paged_attention(sinks=[query_heads]) adds one logit per query head to the softmax denominator "
    "(storage.attention_features lists it)",
    "chunked_attention": "paged_attention(chunk=C) lets a query see only the keys of its own chunk of C "
    "positions (storage.attention_features lists it)",
    "memory_regions": "memory_regions() names the pool's memory (address, shape, device per layer and part, "
    "with a quantized pool's scales), stable while the storage is open, for a transport to register once",
    "state_layers": "recurrent-state layers (LayerSpec(state=...)): the storage's state_storage(arrays, num_slots) "
    "builds a StateStorage (read, write, copy, zero, to_host, from_host, array)",
    "immutable_arrays": "key_cache hands out the current pool array of an immutable array library "
    "(JAX), which later writes replace but never delete, instead of a view",
    "value_head_dim": "a pool whose values are narrower or wider than its keys (CacheConfig.value_head_dim): "
    "value_cache, write, gather, the host form and paged_attention use the value width for values",
    "step_lanes": "step_lane(page_table, slots, qo_indptr) prepares a step's plain layers once: each then writes "
    "its K/V and attends in one call of the returned lane, which declines (writing nothing) arrays it was not "
    "prepared for (kvcache_core.contract.lanes)",
    "layer_geometry": "a pool whose layers differ in KV heads or widths (LayerSpec(num_heads=..., head_dim=..., "
    "value_head_dim=...)): the storage factory may be called once per geometry of one pool (core's "
    "LayeredStorage routes each layer to its part, views a shared page with narrower layers' writes and queries "
    "padded by zeros or, for layers side by side in a page, placed at their offset (the storage's optional "
    "write_view writes one part of each row: kvcache_core.contract.views), and packs swap's host copies); tiers, prefix files, host writes, and transfer of KV-cache "
    "groups whose layers share pages refuse such a pool by name",
}

#: The cache policies of core a backend claims once its storage serves them: every paged
#: pool does through ``copy_blocks``, ``blocks_to_host`` / ``blocks_from_host`` and
#: ``paged_attention`` over a page table with a sliding window.
POLICY_CAPABILITIES: Final = frozenset({"fork", "prefix_caching", "swap", "eviction", "sliding_window"})

#: The per-call features of ``paged_attention`` (``window``, ``softcap``, ``sinks``,
#: ``chunk``), by the capability names a storage's ``attention_features`` lists.
ATTENTION_CAPABILITIES: Final = frozenset({"attention_window", "softcap", "sinks", "chunked_attention"})

#: The capability of a backend whose arrays are immutable (``key_cache`` hands out the
#: current pool array, not a view).
IMMUTABLE_ARRAYS: Final = "immutable_arrays"

#: The capability of a backend that holds values of another width than its keys
#: (``CacheConfig.value_head_dim``); a backend that does not claim it is refused such a pool.
VALUE_HEAD_DIM: Final = "value_head_dim"

#: The capability of a backend whose storage factory builds one part of a pool whose layers
#: differ in geometry (``LayerSpec(num_heads=..., head_dim=...)``); others are refused such a pool.
LAYER_GEOMETRY: Final = "layer_geometry"


def _always_available() -> bool:
    return True


@dataclass(frozen=True)
class BackendSpec(Generic[ArrayT]):
    """What a backend plugin registers; ``ArrayT`` is the backend's native array type.

    Attributes:
        name: the backend's name (``"numpy"``, ``"torch"``, ...), as users pass it to
            :func:`~kvcache_core.create_manager`.
        storage_factory: ``factory(config, **options)`` builds the pool, a
            :class:`~kvcache_core.KvStorage` of ``ArrayT`` (a class conforming to it, or a
            function returning one); it may import the array library. Typed so that a
            storage that does not conform fails mypy and pyright here.
        is_available: whether the backend can run here (library importable, ...).
        unavailable_reason: why not, when ``is_available()`` is false.
        devices: device kinds it supports (``"cpu"``, ``"cuda"``, ...).
        dtypes: dtype names it supports.
        kv_layouts: pool layouts it supports (``"NHD"`` first if supported).
        preferred_layout: the layout it runs fastest, which ``CacheConfig(kv_layout=None)``
            (the default) resolves to; ``None`` means ``kv_layouts[0]``.
        description: one line for ``kvcache backends``.
        capabilities: the optional features it claims, names of :data:`CAPABILITIES`
            (``"fork"``, ``"prefix_caching"``, ``"swap"``, ``"eviction"``,
            ``"sliding_window"``, ``"immutable_arrays"``, ``"value_head_dim"``, and the attention features
            ``"attention_window"``, ``"softcap"``, ``"sinks"``, ``"chunked_attention"``, which
            the storage also lists in its ``attention_features``). The policies are core's, but they
            run only over a storage whose methods serve them, so the conformance kit runs a
            policy's tests only where it is claimed and lists the ones not claimed in its
            verdict (``--kvcache-require-all`` fails on them).
        manager_factory: ``factory(storage, backend=name, placement=...)`` building the
            manager, for a backend that extends :class:`~kvcache_core.PagedKvCacheManager`
            (a fused kernel, a native allocator, ...); ``None`` (the default) uses it as is.
            It must return a ``PagedKvCacheManager``: :func:`~kvcache_core.create_manager`
            raises :class:`~kvcache_core.errors.InvalidTypeError` otherwise.

    Raises:
        InvalidArgumentError: an empty name, or empty devices, dtypes or layouts.
    """

    name: str
    storage_factory: Callable[..., KvStorage[ArrayT]]
    is_available: Callable[[], bool] = _always_available
    unavailable_reason: Callable[[], str] | None = None
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32",)
    kv_layouts: tuple[str, ...] = ("NHD",)
    preferred_layout: str | None = None
    description: str = ""
    capabilities: frozenset[str] = field(default_factory=frozenset[str])
    manager_factory: Callable[..., KvCacheManager[ArrayT]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise InvalidArgumentError(f"BackendSpec.name must be an identifier, got {self.name!r}")
        for attribute in ("devices", "dtypes", "kv_layouts"):
            if not getattr(self, attribute):
                raise InvalidArgumentError(f"BackendSpec.{attribute} of {self.name!r} must not be empty")
        if self.preferred_layout is not None and self.preferred_layout not in self.kv_layouts:
            raise InvalidArgumentError(
                f"BackendSpec.preferred_layout {self.preferred_layout!r} of {self.name!r} is not one of its "
                f"kv_layouts {self.kv_layouts}"
            )

    @property
    def default_layout(self) -> str:
        """The layout ``kv_layout=None`` resolves to on this backend."""
        return self.preferred_layout if self.preferred_layout is not None else self.kv_layouts[0]

    def resolve(self, config: CacheConfig) -> CacheConfig:
        """``config`` with ``kv_layout=None`` resolved to :attr:`default_layout`."""
        return config if config.kv_layout is not None else config.with_layout(self.default_layout)

    def availability(self) -> tuple[bool, str]:
        """``(available, reason)``; an ``is_available`` that raises counts as unavailable."""
        try:
            available = bool(self.is_available())
        except Exception as exc:  # a probe that crashes must not break listing
            return False, f"availability check raised {exc!r}"
        if available:
            return True, ""
        if self.unavailable_reason is None:
            return False, "is_available() returned False"
        try:
            return False, self.unavailable_reason()
        except Exception as exc:
            return False, f"unavailable (reason check raised {exc!r})"

    def check_config(self, config: CacheConfig) -> list[str]:
        """What in ``config`` this backend does not support (empty when all is fine)."""
        problems: list[str] = []
        if config.dtype not in self.dtypes:
            problems.append(f"dtype {config.dtype!r} (supported: {', '.join(self.dtypes)})")
        if config.device.kind not in self.devices:
            problems.append(f"device {str(config.device)!r} (supported kinds: {', '.join(self.devices)})")
        if config.kv_layout is not None and config.kv_layout not in self.kv_layouts:
            problems.append(f"kv_layout {config.kv_layout!r} (supported: {', '.join(self.kv_layouts)})")
        if config.value_head_dim is not None and VALUE_HEAD_DIM not in self.capabilities:
            problems.append(
                f"value_head_dim {config.value_head_dim} beside head_dim {config.head_dim} (values of another width "
                f"than the keys need the {VALUE_HEAD_DIM!r} capability, which it does not claim)"
            )
        if config.mixed_geometry:
            shapes = [config.layer_geometry(layer) for layer in range(config.num_layers)]
            if LAYER_GEOMETRY not in self.capabilities:
                problems.append(
                    f"layers of different geometry ({'; '.join(sorted({str(shape) for shape in shapes}))}: "
                    f"LayerSpec geometry needs the {LAYER_GEOMETRY!r} capability, which it does not claim)"
                )
            wide = [shape for shape in shapes if shape.value_width != shape.head_dim]
            if wide and config.value_head_dim is None and VALUE_HEAD_DIM not in self.capabilities:
                problems.append(
                    f"a layer of {wide[0]} (values of another width than the keys need the {VALUE_HEAD_DIM!r} "
                    "capability, which it does not claim)"
                )
        return problems


class BackendHookSpecs:
    """Hook specifications of project ``"kvcache"``."""

    @hookspec
    def kvcache_register_backends(self) -> Iterable[BackendSpec[Any]]:  # type: ignore[empty-body]
        """Yield the :class:`BackendSpec` records this plugin provides."""
