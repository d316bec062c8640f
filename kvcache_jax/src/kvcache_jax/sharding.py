"""Where the pool lives: one device, or sharded over KV heads on a ``jax.sharding.Mesh`` axis.

Attention, writes and gathers are independent per KV head, so a pool split over heads
needs no communication at all: every kernel runs under ``shard_map`` on each device's own
heads, and its outputs keep the heads sharding. On many hosts the same code runs in every
process (SPMD) after ``jax.distributed.initialize()``, over a mesh of the global devices.
"""

# jaxlib ships no type stubs for its extension module, so pyright sees every JAX signature that
# names a Device as partially Unknown; mypy checks these calls.
# pyright: reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from kvcache_core.contract.config import CacheConfig
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, UnsupportedConfigError
from kvcache_jax.scatter import HEADS_AXIS

__all__ = ["JAX_PLATFORMS", "REPLICATED", "Placement", "partition_spec", "resolve_placement", "shard_over_heads"]

#: JAX platform of each kvcache device kind.
JAX_PLATFORMS: dict[str, str] = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


def partition_spec(*entries: str | None) -> PartitionSpec:
    """``PartitionSpec(*entries)`` (typed: JAX's constructor is not annotated)."""
    return cast("Callable[..., PartitionSpec]", PartitionSpec)(*entries)


#: The spec of an input every device reads whole.
REPLICATED = partition_spec()


def _heads_spec(rank: int, heads_axis: int, axis: str | None) -> PartitionSpec:
    entries: list[str | None] = [None] * rank
    if axis is not None:
        entries[heads_axis] = axis
    return partition_spec(*entries)


@dataclass(frozen=True)
class Placement:
    """One device, or a mesh axis the KV heads are split over.

    Attributes:
        device: the ``jax.Device`` of an unsharded pool (``None`` with a mesh).
        mesh: the mesh of a sharded pool (``None`` on one device).
        axis: the mesh axis the heads are split over (``None`` on one device).
    """

    device: Any
    mesh: Mesh | None = None
    axis: str | None = None

    def _sharding(self, spec: PartitionSpec) -> Sharding:
        if self.mesh is None:
            assert self.device is not None
            return SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, spec)

    def pool(self, kv_layout: str) -> Sharding:
        """Sharding of one layer's key (or value) pool."""
        return self._sharding(self.pool_spec(kv_layout))

    def pool_spec(self, kv_layout: str) -> PartitionSpec:
        """``PartitionSpec`` of a pool: the heads axis on the mesh axis."""
        return _heads_spec(4, HEADS_AXIS[kv_layout], self.axis)

    @property
    def tokens_spec(self) -> PartitionSpec:
        """``PartitionSpec`` of ``[n, heads, dim]`` tokens and queries."""
        return _heads_spec(3, 1, self.axis)

    @property
    def heads_spec(self) -> PartitionSpec:
        """``PartitionSpec`` of a ``[query_heads]`` array (attention sinks), split as the queries' heads."""
        return _heads_spec(1, 0, self.axis)

    @property
    def tokens(self) -> Sharding:
        """Sharding of ``[n, heads, dim]`` tokens (keys, values, queries, outputs)."""
        return self._sharding(self.tokens_spec)

    def heads_at(self, rank: int, heads_axis: int) -> PartitionSpec:
        """``PartitionSpec`` of any rank-``rank`` array whose axis ``heads_axis`` holds the KV
        heads (a quantized pool's scales, ``[heads, num_blocks, block_size]``: ``(3, 0)``)."""
        return _heads_spec(rank, heads_axis, self.axis)

    def sharding(self, spec: PartitionSpec) -> Sharding:
        """The sharding of ``spec`` here (on one device: that device)."""
        return self._sharding(spec)

    @property
    def host_blocks_spec(self) -> PartitionSpec:
        """``PartitionSpec`` of ``[layers, n, block_size, heads, dim]`` block copies."""
        return _heads_spec(5, 3, self.axis)

    @property
    def host_blocks(self) -> Sharding:
        """Sharding of ``[layers, n, block_size, heads, dim]`` block copies."""
        return self._sharding(self.host_blocks_spec)

    @property
    def replicated(self) -> Sharding:
        """Sharding of small inputs every device reads whole (slots, block tables)."""
        return self._sharding(REPLICATED)

    @property
    def shards(self) -> int:
        """Devices the heads are split over."""
        return 1 if self.mesh is None or self.axis is None else int(self.mesh.shape[self.axis])


def _device_for(config: CacheConfig) -> Any:
    platform = JAX_PLATFORMS.get(config.device.kind, config.device.kind)
    try:
        devices = jax.devices(platform)
    except RuntimeError as exc:
        raise UnsupportedConfigError(
            f"device {str(config.device)!r}: JAX has no {platform} devices here "
            f"(it has: {', '.join(sorted({d.platform for d in jax.devices()}))})"
        ) from exc
    index = config.device.index or 0
    if index >= len(devices):
        raise UnsupportedConfigError(
            f"device {str(config.device)!r} is out of range: JAX has {len(devices)} {platform} devices (0 to {len(devices) - 1})"
        )
    return devices[index]


def resolve_placement(config: CacheConfig, mesh: object = None, axis: object = None) -> Placement:
    """The placement of a pool for ``config`` and the factory's ``mesh``/``axis`` options.

    Raises:
        InvalidTypeError: ``mesh`` is not a ``jax.sharding.Mesh``, or ``axis`` not a str.
        InvalidArgumentError: ``axis`` without a mesh, not one of the mesh's axes, or
            missing on a mesh of several axes.
        UnsupportedConfigError: no JAX device matches ``config.device``; the mesh's devices
            are of another kind; ``num_heads`` is not divisible by the axis size.
    """
    if mesh is None:
        if axis is not None:
            raise InvalidArgumentError(f"axis={axis!r} needs a mesh: pass mesh=jax.sharding.Mesh(...)")
        return Placement(_device_for(config))
    if not isinstance(mesh, Mesh):
        raise InvalidTypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(str(name) for name in mesh.axis_names)
    if axis is None:
        if len(names) != 1:
            raise InvalidArgumentError(f"the mesh has axes {names}: say which one splits the KV heads with axis=...")
        axis = names[0]
    if not isinstance(axis, str):
        raise InvalidTypeError(f"axis must be a mesh axis name (str), got {axis!r}")
    if axis not in names:
        raise InvalidArgumentError(f"axis {axis!r} is not an axis of the mesh; its axes are {names}")
    platform = JAX_PLATFORMS.get(config.device.kind, config.device.kind)
    mesh_platforms = sorted({str(device.platform) for device in mesh.devices.flat})
    if mesh_platforms != [platform]:
        raise UnsupportedConfigError(
            f"the mesh's devices are {', '.join(mesh_platforms)}, but config.device is {str(config.device)!r}"
        )
    size = int(mesh.shape[axis])
    if config.num_heads % size:
        raise UnsupportedConfigError(
            f"num_heads={config.num_heads} KV heads cannot be split evenly over mesh axis {axis!r} of size "
            f"{size}; use a head count divisible by {size}"
        )
    return Placement(None, mesh, axis)


def shard_over_heads(
    function: Callable[..., Any], placement: Placement, in_specs: tuple[Any, ...], out_specs: Any
) -> Callable[..., Any]:
    """``function`` run per device on its own heads (``shard_map``), or as is on one device."""
    if placement.mesh is None:
        return function
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is not None:
        mapped = shard_map(function, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    else:  # jax < 0.7: the experimental module
        from jax.experimental import shard_map as legacy

        legacy_shard_map: Callable[..., Any] = getattr(legacy, "shard_map")  # noqa: B009 - untyped
        mapped = legacy_shard_map(
            function, mesh=placement.mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False
        )
    return cast("Callable[..., Any]", mapped)
