"""The torch storage: one pool tensor on any torch device, and the kernels that move its bytes.

:class:`TorchStorage` satisfies :class:`kvcache_core.KvStorage` for ``torch.Tensor`` structurally.
The manager validates every argument before calling it; this module only moves bytes. Its one
check of its own is :meth:`TorchStorage.array_info`: anything but a tensor on the pool's device
is refused there, so the manager raises :class:`~kvcache_core.errors.ArrayTypeError` first.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention.features import combined_window
from kvcache_core.contract import quantization
from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.groups import ViewPlace
from kvcache_core.contract.page_table import PageTable
from kvcache_core.contract.regions import MemoryRegion, pool_regions
from kvcache_core.contract.states import StateArray
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, UnsupportedConfigError
from kvcache_core.offload import host_form
from kvcache_torch import quantized
from kvcache_torch.attention import attend_pool
from kvcache_torch.devices import resolve_device
from kvcache_torch.dispatch import pool_path
from kvcache_torch.dtypes import BIT_DTYPES, VALUE_DTYPES, dtype_name, tensor_of, torch_dtype
from kvcache_torch.lanes import LaneMemory, TorchLane
from kvcache_torch.padded import PaddedReader
from kvcache_torch.scatter import scatter
from kvcache_torch.spec import ATTENTION_FEATURES, PREFERRED_LAYOUT
from kvcache_torch.states import TorchStateStorage

__all__ = ["TorchStorage", "resolve_device"]

IntArray = npt.NDArray[np.int64]
TensorPair = tuple[torch.Tensor, torch.Tensor]


class TorchStorage:
    """A pool of ``num_layers x (K, V)`` tensors in one allocation on one torch device.

    The pool is ``[num_layers, 2, *config.block_shape()]`` (with a ``value_head_dim``,
    ``[num_layers, keys + values]``: each layer's keys then its values, flat);
    ``key_cache(layer)`` and ``value_cache(layer)`` are views of it, so a later :meth:`write`
    shows through a reference taken before it. Bytes leave the device only through :meth:`gather`,
    :meth:`blocks_to_host` and :meth:`to_numpy`.

    Host copies (``blocks_to_host``) are core's host form (:mod:`kvcache_core.offload.host_form`):
    a bfloat16 pool's are ``uint16`` bit patterns, bit-identical through a round trip and loadable
    into a JAX or NumPy-side pool; ``to_numpy`` gives bfloat16 values as float32 (exact). On CUDA
    copies are staged through pinned host memory.

    A quantized pool (``int8``, ``float8_e4m3fn``: :mod:`kvcache_core.contract.quantization`) holds raw
    values in the pool and their scales in :attr:`scales` ``[num_layers, 2, num_heads,
    num_blocks, block_size]`` float32 on the same device, moved with their blocks; ``write``
    takes and ``gather`` and attention return the config's compute dtype; host copies are
    core's packed ``uint8`` form (raw bytes + scale per token head).

    Attributes:
        attention_features: the attention capabilities :meth:`paged_attention` serves
            (all of :data:`~kvcache_core.contract.hookspecs.ATTENTION_CAPABILITIES`).

    Raises:
        UnsupportedConfigError: a dtype the backend does not hold, or a device not present.
    """

    attention_features: frozenset[str] = ATTENTION_FEATURES

    def __init__(self, config: CacheConfig) -> None:
        config = config.with_layout(PREFERRED_LAYOUT)  # kv_layout=None: the fastest here
        self._config = config
        self._dtype = torch_dtype(config.dtype)
        self._device = resolve_device(config)
        self._path = pool_path(config.attention_path, self._device)
        self._split = config.value_head_dim is not None
        if self._split:  # [layer, keys then values]: the two widths in one allocation
            key_elements = math.prod(config.block_shape())
            shape: tuple[int, ...] = (config.num_layers, key_elements + math.prod(config.value_block_shape()))
        else:  # [layer, K/V, *layout]: one block copy moves every layer at once.
            shape = (config.num_layers, 2, *config.block_shape())
        self._pool = torch.zeros(shape, dtype=self._dtype, device=self._device)
        self._block_axis = 3 if config.kv_layout == "heads_first" else 2
        self._bits_dtype = BIT_DTYPES.get(self._dtype, self._dtype)  # what host copies are cut from
        self._scales: torch.Tensor | None = None
        # What the byte-moving kernels index: a quantized pool as its bytes (torch has no
        # index_copy_ / index_select for float8 on every device), any other pool itself.
        self._moved = self._pool.view(torch.uint8) if config.quantized else self._pool
        self._parts = self._split_parts(self._pool)
        self._moved_parts = self._split_parts(self._moved)
        self._views, self._targets = self._layer_views()
        self._lane_memory = LaneMemory(config.num_layers)  # what steps' lanes keep between steps
        # The last slot array converted and its tensor (a step's layers pass one frozen array).
        self._index_memo: tuple[IntArray, torch.Tensor] | None = None
        self._padded = PaddedReader(config.kv_layout == "heads_first", self._device)
        if config.quantized:
            self._io_dtype = torch_dtype(config.io_dtype)
            self._scales = torch.zeros(
                (config.num_layers, 2, config.num_heads, config.num_blocks, config.block_size),
                dtype=torch.float32,
                device=self._device,
            )
            calibrated = config.kv_scales is not None
            head_scales = np.asarray(config.kv_scales if calibrated else 0.0, dtype=np.float32) * np.ones(
                (config.num_layers, 2, config.num_heads), dtype=np.float32
            )
            self._head_scales = tensor_of(head_scales).to(self._device)
            self._track_scales = not calibrated

    def _layer_views(self) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor]], tuple[list[torch.Tensor], ...]]:
        """Per layer, made once: the K and V views attention reads and (NHD, heads-first) the flat
        views ``[slots, H, D]``, ``[H, slots, D]`` a write indexes (a quantized pool's bytes)."""
        views = (list(self._parts[0].unbind(0)), list(self._parts[1].unbind(0)))
        axes = {"NHD": (0, 1), "heads_first": (1, 2)}.get(self._config.layout)  # HND: none
        if axes is None:
            return views, ()
        return views, tuple([x.flatten(*axes) for x in part.unbind(0)] for part in self._moved_parts)

    def _split_parts(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` views ``[num_layers, *layout]`` of a pool tensor."""
        config = self._config
        if not self._split:
            return pool[:, 0], pool[:, 1]
        key_elements = math.prod(config.block_shape())
        return (
            pool[:, :key_elements].view(config.num_layers, *config.block_shape()),
            pool[:, key_elements:].view(config.num_layers, *config.value_block_shape()),
        )

    # -- the pool -------------------------------------------------------------------------

    @property
    def config(self) -> CacheConfig:
        """The pool's configuration."""
        return self._config

    @property
    def device(self) -> torch.device:
        """The torch device the pool lives on."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The pool's torch dtype."""
        return self._dtype

    @property
    def pool(self) -> torch.Tensor:
        """The whole pool ``[num_layers, 2, *config.block_shape()]`` (K at index 0, V at 1);
        with a ``value_head_dim``, ``[num_layers, keys + values]`` (each layer's keys, then
        its values, flat)."""
        return self._pool

    def close(self) -> None:
        """Drop the pool tensor, so its device memory goes back to torch once no view a
        caller still holds refers to it (on CUDA, to the caching allocator, for reuse).
        ``manager.close()`` calls this; the storage is not used afterwards."""
        self._pool = torch.empty((0,), dtype=self._dtype, device=self._device)
        self._moved = self._pool
        self._parts = self._moved_parts = (self._pool, self._pool)
        self._views, self._targets = self._layer_views()  # none: an empty pool
        self._lane_memory = LaneMemory(0)
        self._index_memo = None
        if self._scales is not None:
            self._scales = torch.empty((0,), dtype=torch.float32, device=self._device)

    @property
    def scales(self) -> torch.Tensor | None:
        """A quantized pool's scales ``[num_layers, 2, num_heads, num_blocks, block_size]``
        (``raw * scale`` is the value); ``None`` for an unquantized pool."""
        return self._scales

    def memory_regions(self) -> tuple[MemoryRegion, ...]:
        """The pool's memory per layer and part (:mod:`kvcache_core.contract.regions`): host
        memory on CPU, device memory on CUDA; stable until :meth:`close`."""
        device, scales = self._device, None if self._scales is None else int(self._scales.data_ptr())
        pool, element = int(self._pool.data_ptr()), self._pool.element_size()
        return pool_regions(self._config, pool, element, scales, device_kind=device.type, device_id=device.index or 0)

    def step_lane(self, page_table: PageTable, slots: IntArray, qo_indptr: npt.NDArray[np.int32]) -> TorchLane | None:
        """A step's lane for its plain layers (capability ``"step_lanes"``:
        :mod:`kvcache_torch.lanes`); ``None`` for a quantized pool or the HND layout."""
        if self._scales is not None or not self._targets:
            return None
        views = (self._views, self._targets, self._lane_memory)
        return TorchLane(
            *views, self._config.layout, self._path, self._dtype, self._device, page_table, slots, qo_indptr
        )

    def gather_padded(self, layer: int, slots: IntArray, layout: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step's padded batch in one indexed read per pool (:mod:`kvcache_torch.padded`);
        ``None`` for a quantized pool or the HND layout (core then gathers request by request)."""
        if self._scales is not None or not self._targets:
            return None
        return self._padded.read(self._targets[0][layer], self._targets[1][layer], slots, layout)

    def view_padded(self, layer: int, first_slot: int, positions: int, layout: str) -> TensorPair | None:
        """One request's run of slots as a padded batch of one row, views of the pool
        (:mod:`kvcache_core.contract.padded`); ``None`` as :meth:`gather_padded`."""
        if self._scales is not None or not self._targets:  # a quantized pool's are its bytes
            return None
        return self._padded.view(self._targets[0][layer], self._targets[1][layer], first_slot, positions, layout)

    def key_cache(self, layer: int) -> torch.Tensor:
        """View of the layer's key pool, in the configured layout."""
        return self._views[0][layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        """View of the layer's value pool, in the configured layout (last axis ``value_width``)."""
        return self._views[1][layer]

    # -- data path ------------------------------------------------------------------------

    def _index(self, indices: IntArray) -> torch.Tensor:
        """Host int64 indices as a tensor on the pool's device (the same tensor again for the
        same frozen array: a read-only view of a read-only base, as a step's slots are)."""
        memo = self._index_memo
        if memo is not None and memo[0] is indices:
            return memo[1]
        tensor = tensor_of(np.ascontiguousarray(indices, dtype=np.int64))
        tensor = tensor if self._device.type == "cpu" else tensor.to(self._device, non_blocking=True)
        base = indices.base
        if not indices.flags.writeable and isinstance(base, np.ndarray) and not base.flags.writeable:
            self._index_memo = (indices, tensor)
        return tensor

    def write(self, layer: int, slots: IntArray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Scatter ``[n, num_heads, head_dim]`` keys and ``[n, num_heads, value_width]`` values
        into distinct ``slots``: one indexed copy per pool (K, V) for the whole batch."""
        slot_index = self._index(slots)
        if self._scales is not None:
            raw_keys, raw_values = self._quantize(layer, slot_index, keys, values)
            keys, values = raw_keys.view(torch.uint8), raw_values.view(torch.uint8)
        # keys that need grad must not make the pool record autograd
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            scatter(self._write_targets(layer), self._config, slot_index, keys, values)

    def write_view(
        self, layer: int, slots: IntArray, keys: torch.Tensor, values: torch.Tensor, place: ViewPlace
    ) -> None:
        """Scatter into the part of each slot's row from ``place``, the rest kept (an
        unquantized pool; :mod:`kvcache_core.contract.views`): one indexed copy per pool."""
        with torch.no_grad():
            scatter(self._write_targets(layer), self._config, self._index(slots), keys, values, place)

    def _write_targets(self, layer: int) -> TensorPair:
        """What a write of ``layer`` indexes (:func:`kvcache_torch.scatter.scatter`; a quantized
        pool's bytes): the flat views (NHD, heads-first) or the token-major view (HND)."""
        if self._config.kv_layout == "HND":
            return self._moved_parts[0][layer].transpose(1, 2), self._moved_parts[1][layer].transpose(1, 2)
        return self._targets[0][layer], self._targets[1][layer]

    def _quantize(
        self, layer: int, slot_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw K/V for the slots; their scales written once every check passed.

        Raises:
            InvalidArgumentError: NaN or an infinity in ``keys`` or ``values`` (nothing changed).
        """
        assert self._scales is not None
        quantized.check_finite("keys", keys)
        quantized.check_finite("values", values)
        config = self._config
        head_scales = self._head_scales[layer]
        if config.dtype == "float8_e4m3fn" and self._track_scales:
            head_scales = torch.stack(
                [quantized.grow_running_scales(head_scales[kv], data) for kv, data in ((0, keys), (1, values))]
            )
        raw_keys, key_scales = quantized.quantize(config.dtype, self._dtype, keys, head_scales[0])
        raw_values, value_scales = quantized.quantize(config.dtype, self._dtype, values, head_scales[1])
        with torch.no_grad():
            self._head_scales[layer] = head_scales
            blocks = torch.div(slot_index, config.block_size, rounding_mode="floor")
            offsets = slot_index - blocks * config.block_size
            for kv, scales in ((0, key_scales), (1, value_scales)):
                self._scales[layer, kv].permute(1, 2, 0).index_put_((blocks, offsets), scales)
        return raw_keys, raw_values

    def gather(self, layer: int, blocks: IntArray, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[num_tokens, num_heads, head_dim]`` copies of the tokens in ``blocks``
        (dequantized to the compute dtype for a quantized pool)."""
        index = self._index(blocks)
        if self._scales is not None:
            decoded: list[torch.Tensor] = []
            for kv in (0, 1):
                raw = self._tokens(self._moved_parts[kv][layer], index, num_tokens).view(self._dtype)
                scales = self._scales[layer, kv].index_select(1, index).permute(1, 2, 0)
                scales = scales.reshape(-1, self._config.num_heads)[:num_tokens]
                decoded.append((raw.to(torch.float32) * scales[:, :, None]).to(self._io_dtype))
            return decoded[0], decoded[1]
        keys, values = self._parts[0][layer], self._parts[1][layer]
        return self._tokens(keys, index, num_tokens), self._tokens(values, index, num_tokens)

    def _tokens(self, cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        heads, dim = self._config.num_heads, int(cache.shape[-1])
        layout = self._config.kv_layout
        if layout == "NHD":
            picked = cache.index_select(0, blocks)
        elif layout == "HND":
            picked = cache.index_select(0, blocks).transpose(1, 2)
        else:
            picked = cache.index_select(1, blocks).permute(1, 2, 0, 3)
        return picked.reshape(-1, heads, dim)[:num_tokens].contiguous()

    def copy_blocks(self, source: IntArray, destination: IntArray) -> None:
        """Copy every layer's K and V of ``source[i]`` into ``destination[i]`` (the sources
        are read before any destination is written)."""
        if self._split:
            for part in self._moved_parts:
                picked = part.index_select(self._block_axis - 1, self._index(source))
                part.index_copy_(self._block_axis - 1, self._index(destination), picked)
        else:
            picked = self._moved.index_select(self._block_axis, self._index(source))
            self._moved.index_copy_(self._block_axis, self._index(destination), picked)
        if self._scales is not None:  # [L, 2, H, blocks, bs]
            scales = self._scales.index_select(3, self._index(source))
            self._scales.index_copy_(3, self._index(destination), scales)

    def blocks_to_host(self, blocks: IntArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Host copies ``[num_layers, n, block_size, num_heads, head_dim]`` of keys and values
        in core's host form (``uint16`` bit patterns for a bfloat16 pool; through pinned
        memory on CUDA); values ``value_width`` wide."""
        if self._split:
            return self._split_to_host(blocks)
        picked = self._to_canonical(self._moved.index_select(self._block_axis, self._index(blocks)))
        if self._scales is not None:  # packed: raw bytes + scale per token head
            raw = picked.contiguous().cpu().numpy()
            scales = self._scales.index_select(3, self._index(blocks)).permute(0, 1, 3, 4, 2).cpu().numpy()
            packed = quantization.pack_host(raw, scales)
            return np.ascontiguousarray(packed[:, 0]), np.ascontiguousarray(packed[:, 1])
        return self._host_copy(picked[:, 0]), self._host_copy(picked[:, 1])

    def blocks_from_host(self, blocks: IntArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """Write host-form copies (:mod:`kvcache_core.offload.host_form`, from any backend) into ``blocks``.

        Raises:
            ArrayTypeError: not NumPy arrays.
            ShapeMismatchError: arrays not ``[num_layers, len(blocks), block_size, num_heads, width]``.
            DTypeMismatchError: arrays of another dtype than the host form (nothing is cast).
        """
        config = self._config
        shape = host_form.host_shape(config, len(blocks))
        host_form.check_host_array(config, "keys", keys, shape)
        host_form.check_host_array(config, "values", values, host_form.host_shape(config, len(blocks), "values"))
        if self._split:
            self._split_from_host(blocks, keys, values)
            return
        if self._scales is not None:
            self._quantized_from_host(blocks, keys, values, shape[:-1])
            return
        stacked = torch.stack([self._from_host(keys), self._from_host(values)], dim=1)  # [L, 2, n, bs, H, D]
        self._pool.index_copy_(self._block_axis, self._index(blocks), self._in_layout(stacked))

    def _quantized_from_host(
        self, blocks: IntArray, keys: npt.NDArray[Any], values: npt.NDArray[Any], leading: tuple[int, ...]
    ) -> None:
        """Write packed host copies (raw bytes + scales) of a quantized pool into ``blocks``."""
        assert self._scales is not None
        raws: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for name, array in (("keys", keys), ("values", values)):
            raw, scale = quantization.unpack_host(self._config, array, name)
            assert tuple(scale.shape) == leading  # checked by the caller
            raws.append(tensor_of(raw.view(np.uint8)).to(self._device))
            scales.append(tensor_of(scale).to(self._device))
        stacked = self._in_layout(torch.stack(raws, dim=1))  # [L, 2, n, bs, H, D] in the layout
        index = self._index(blocks)
        self._moved.index_copy_(self._block_axis, index, stacked)
        self._scales.index_copy_(3, index, torch.stack(scales, dim=1).permute(0, 1, 4, 2, 3))

    def _split_to_host(self, blocks: IntArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """:meth:`blocks_to_host` of a pool whose values differ in width from its keys."""
        index = self._index(blocks)
        copies: list[npt.NDArray[Any]] = []
        for kv, part in enumerate(self._moved_parts):
            picked = self._to_canonical(part.index_select(self._block_axis - 1, index), 1)
            if self._scales is None:
                copies.append(self._host_copy(picked))
                continue
            scales = self._scales[:, kv].index_select(2, index).permute(0, 2, 3, 1).cpu().numpy()
            copies.append(quantization.pack_host(picked.contiguous().cpu().numpy(), scales))
        return copies[0], copies[1]

    def _split_from_host(self, blocks: IntArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """:meth:`blocks_from_host` of a pool whose values differ in width from its keys."""
        index = self._index(blocks)
        for kv, (name, array) in enumerate((("keys", keys), ("values", values))):
            if self._scales is not None:
                raw, scale = quantization.unpack_host(self._config, array, name)
                data = tensor_of(raw.view(np.uint8)).to(self._device)
                self._scales[:, kv].index_copy_(2, index, tensor_of(scale).to(self._device).permute(0, 3, 1, 2))
            else:
                data = self._from_host(array)
            self._moved_parts[kv].index_copy_(self._block_axis - 1, index, self._in_layout(data))  # [L, n, bs, H, D]

    def _in_layout(self, blocks: torch.Tensor) -> torch.Tensor:
        """Host-form blocks ``[..., n, block_size, heads, dim]`` in the pool's layout (a view)."""
        layout = self._config.kv_layout
        if layout == "HND":
            return blocks.transpose(-3, -2)
        return blocks.movedim(-2, -4) if layout == "heads_first" else blocks

    def _to_canonical(self, picked: torch.Tensor, leading: int = 2) -> torch.Tensor:
        """``[L, 2, *layout over n blocks]`` (``leading`` 2; one part ``[L, *layout]``: 1) ->
        ``[L, 2, n, block_size, heads, dim]`` (``[L, n, ...]``), a view."""
        if self._config.kv_layout == "HND":  # [..., n, H, bs, D]
            return picked.transpose(leading + 1, leading + 2)
        if self._config.kv_layout == "heads_first":  # [..., H, n, bs, D]
            return picked.permute(*range(leading), leading + 1, leading + 2, leading, leading + 3)
        return picked

    def _host_copy(self, tensor: torch.Tensor) -> npt.NDArray[Any]:
        """A contiguous host NumPy copy in host form (bfloat16 bit-cast to its 16-bit
        patterns, read as ``uint16``), through pinned memory on CUDA."""
        bits = tensor.contiguous().view(self._bits_dtype)
        if self._device.type == "cpu":
            host = bits  # ``tensor`` is a fresh copy already, never the pool
        else:
            host = torch.empty(tuple(tensor.shape), dtype=self._bits_dtype, pin_memory=True)
            host.copy_(bits, non_blocking=True)
            torch.cuda.synchronize(self._device)
        array = host.numpy()
        return array.view(host_form.host_dtype(self._config.dtype))

    def _from_host(self, array: npt.NDArray[Any]) -> torch.Tensor:
        """A host-form array on the pool's device in the pool's dtype, bit for bit (through
        pinned memory on CUDA)."""
        contiguous = np.ascontiguousarray(array)
        if self._bits_dtype != self._dtype:  # uint16 patterns -> int16 (torch's) -> bfloat16
            contiguous = contiguous.view(np.int16)
        tensor = tensor_of(contiguous)
        if self._device.type != "cpu":
            tensor = tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.view(self._dtype)

    # -- attention ------------------------------------------------------------------------

    def paged_attention(
        self,
        layer: int,
        query: torch.Tensor,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """Attention over the layer's pool, read in place (arguments validated by the
        manager), with the attention features of :mod:`kvcache_core.attention.features`.
        A quantized pool is dequantized while read: on CPU by the compiled kernel, tile by
        tile, elsewhere by :func:`kvcache_torch.quantized.attend_quantized`, run by run."""
        if self._scales is not None:
            features = {"window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
            return self._quantized_attention(layer, query, page_table, qo_indptr, scale, causal, features)
        return attend_pool(
            query,
            self._views[0][layer],
            self._views[1][layer],
            page_table,
            qo_indptr,
            scale,
            causal,
            self._config.layout,
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
            path=self._path,
        )

    def _quantized_attention(
        self,
        layer: int,
        query: torch.Tensor,
        page_table: PageTable,
        qo_indptr: npt.NDArray[np.int32],
        scale: float,
        causal: bool,
        features: dict[str, Any],
    ) -> torch.Tensor:
        assert self._scales is not None
        config = self._config
        keys, values = self._views[0][layer], self._views[1][layer]
        window, softcap, chunk = features["window"], features["softcap"], features["chunk"]
        sinks: torch.Tensor | None = features["sinks"]
        wanted = sorted(name for name, value in features.items() if value is not None)
        if self._device.type == "cpu" and query.shape[0]:
            output = quantized.kernel_attention(
                query,
                (keys, values),
                (self._scales[layer, 0], self._scales[layer, 1]),
                page_table,
                qo_indptr,
                config.dtype,
                config.layout,
                scale=scale,
                causal=causal,
                window=combined_window(window, page_table.sliding_window),
                softcap=softcap,
                sinks=sinks,
                chunk=chunk,
            )
            if output is not None:
                return output
        if wanted:
            raise UnsupportedConfigError(
                f"the attention features {wanted} on a quantized {config.dtype} pool are served by the compiled "
                f"CPU kernel only (numba on a CPU pool); this pool is on {self._device}"
            )
        return quantized.attend_quantized(
            query,
            keys,
            values,
            self._scales[layer, 0],
            self._scales[layer, 1],
            page_table,
            qo_indptr,
            scale,
            causal,
            config.layout,
        )

    # -- arrays ---------------------------------------------------------------------------

    def array_info(self, array: object) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype name)`` of a tensor on the pool's device.

        Raises:
            TypeError: ``array`` is not a ``torch.Tensor``, or lives on another device (the
                manager turns this into :class:`~kvcache_core.errors.ArrayTypeError`).
        """
        if not isinstance(array, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(array).__name__}")
        if array.device != self._device:
            raise TypeError(f"expected a torch.Tensor on {self._device} (the pool's device), got one on {array.device}")
        return tuple(array.shape), dtype_name(array.dtype)

    def from_numpy(self, array: npt.NDArray[Any]) -> torch.Tensor:
        """A tensor on the pool's device with the same values and dtype (on CPU it shares the
        array's memory when it can).

        Raises:
            ArrayTypeError: ``array`` is not a NumPy array.
            DTypeMismatchError: a NumPy dtype torch cannot hold.
        """
        if not isinstance(array, np.ndarray):
            raise ArrayTypeError(f"from_numpy takes a numpy.ndarray, got {type(array).__name__}")
        if not array.flags.writeable:  # torch cannot share read-only memory
            array = array.copy()
        try:
            tensor = tensor_of(array)
        except TypeError as exc:
            raise DTypeMismatchError(f"torch cannot hold the NumPy dtype {array.dtype}: {exc}") from exc
        return tensor if self._device.type == "cpu" else tensor.to(self._device)

    def to_numpy(self, array: torch.Tensor) -> npt.NDArray[Any]:
        """A host NumPy array with the same values: bfloat16 becomes float32 (exact); a
        CPU tensor's memory is shared when its dtype is kept.

        Raises:
            ArrayTypeError: ``array`` is not a ``torch.Tensor``.
        """
        if not isinstance(array, torch.Tensor):
            raise ArrayTypeError(f"to_numpy takes a torch.Tensor, got {type(array).__name__}")
        tensor = array.detach()
        target = VALUE_DTYPES.get(tensor.dtype, tensor.dtype)
        return tensor.to(device="cpu", dtype=target).numpy()

    def array_namespace(self) -> Any:
        """The Array API namespace of torch tensors (``array_api_compat.torch``)."""
        import array_api_compat.torch

        return array_api_compat.torch

    def state_storage(self, arrays: tuple[StateArray, ...], num_slots: int) -> TorchStateStorage:
        """The state pool of a config with recurrent-state layers, on the pool's device
        (capability ``"state_layers"``).

        Raises:
            UnsupportedConfigError: a state array of a dtype the backend does not hold.
        """
        return TorchStateStorage(arrays, num_slots, self._device)

    def __repr__(self) -> str:
        config = self._config
        return (
            f"TorchStorage(layers={config.num_layers}, blocks={config.num_blocks}x{config.block_size}, "
            f"heads={config.num_heads}, head_dim={config.head_dim}, dtype={config.dtype}, "
            f"layout={config.kv_layout}, device={self._device})"
        )
