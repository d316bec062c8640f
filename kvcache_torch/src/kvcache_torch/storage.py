"""The torch storage: one pool tensor on any torch device, and the kernels that move its bytes.

:class:`TorchStorage` satisfies :class:`kvcache_core.KvStorage` for ``torch.Tensor``
structurally. The manager validates every argument before calling it (slots in range and
in use, shapes and dtypes right); this module only moves bytes. Its one check of its own
is :meth:`TorchStorage.array_info`, which the manager asks about every array it is
handed: anything but a tensor on the pool's device is refused there, so the manager
raises :class:`~kvcache_core.errors.ArrayTypeError` before any state changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcache_core.attention_features import ATTENTION_CAPABILITIES
from kvcache_core.config import CacheConfig
from kvcache_core.errors import ArrayTypeError, DTypeMismatchError, ShapeMismatchError, UnsupportedConfigError
from kvcache_core.page_table import PageTable
from kvcache_torch.attention import attend_pool
from kvcache_torch.dtypes import HOST_DTYPES, dtype_name, torch_dtype

__all__ = ["TorchStorage", "resolve_device"]

IntArray = npt.NDArray[np.int64]


def _tensor_of(array: npt.NDArray[Any]) -> torch.Tensor:
    """``torch.from_numpy`` with its parameter typed (torch leaves it unannotated); a
    read-only array (a step's slots, a page table's indices) is copied, as torch has no
    read-only tensors."""
    if not array.flags.writeable:
        array = array.copy()
    tensor: torch.Tensor = torch.from_numpy(array)  # pyright: ignore[reportUnknownMemberType]
    return tensor


def resolve_device(config: CacheConfig) -> torch.device:
    """The torch device of ``config.device``, checked to be present here.

    Raises:
        UnsupportedConfigError: a CUDA device without a usable GPU, or an index past the
            last GPU (the message says how many there are).
    """
    device = config.device
    if device.kind == "cpu":
        return torch.device("cpu")
    if device.kind == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedConfigError(
                f"device {str(device)!r} is not available: torch {torch.__version__} sees no CUDA GPU here; "
                "use device 'cpu'"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise UnsupportedConfigError(
                f"device {str(device)!r} is not available: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    raise UnsupportedConfigError(f"the torch backend supports devices cpu and cuda, got {str(device)!r}")


class TorchStorage:
    """A pool of ``num_layers x (K, V)`` tensors in one allocation on one torch device.

    The pool is ``[num_layers, 2, *config.block_shape()]``; ``key_cache(layer)`` and
    ``value_cache(layer)`` are views of it, so a later :meth:`write` shows through a
    reference taken before it. Bytes leave the device only through :meth:`gather`,
    :meth:`blocks_to_host` and :meth:`to_numpy`.

    Host copies (``blocks_to_host``, ``to_numpy``) of a bfloat16 pool are float32 NumPy
    arrays (NumPy has no bfloat16; float32 holds every bfloat16 value exactly, so a round
    trip is bit-identical). On CUDA they are staged through pinned host memory.

    Attributes:
        attention_features: the attention capabilities :meth:`paged_attention` serves
            (all of :data:`~kvcache_core.attention_features.ATTENTION_CAPABILITIES`).

    Raises:
        UnsupportedConfigError: a dtype the backend does not hold, or a device not present.
    """

    attention_features: frozenset[str] = ATTENTION_CAPABILITIES

    def __init__(self, config: CacheConfig) -> None:
        from kvcache_torch.plugin import PREFERRED_LAYOUT

        config = config.with_layout(PREFERRED_LAYOUT)  # kv_layout=None: the fastest here
        self._config = config
        self._dtype = torch_dtype(config.dtype)
        self._device = resolve_device(config)
        # [layer, K/V, *layout]: one block copy moves every layer at once.
        self._pool = torch.zeros((config.num_layers, 2, *config.block_shape()), dtype=self._dtype, device=self._device)
        self._block_axis = 3 if config.kv_layout == "heads_first" else 2
        self._host_dtype = HOST_DTYPES.get(self._dtype, self._dtype)

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
        """The whole pool ``[num_layers, 2, *config.block_shape()]`` (K at index 0, V at 1)."""
        return self._pool

    def close(self) -> None:
        """Drop the pool tensor, so its device memory goes back to torch once no view a
        caller still holds refers to it (on CUDA, to the caching allocator, for reuse).
        ``manager.close()`` calls this; the storage is not used afterwards."""
        self._pool = torch.empty((0,), dtype=self._dtype, device=self._device)

    def key_cache(self, layer: int) -> torch.Tensor:
        """View of the layer's key pool, in the configured layout."""
        return self._pool[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """View of the layer's value pool, in the configured layout."""
        return self._pool[layer, 1]

    # -- data path ------------------------------------------------------------------------

    def _index(self, indices: IntArray) -> torch.Tensor:
        """Host int64 indices as a tensor on the pool's device."""
        tensor = _tensor_of(np.ascontiguousarray(indices, dtype=np.int64))
        return tensor if self._device.type == "cpu" else tensor.to(self._device, non_blocking=True)

    def write(self, layer: int, slots: IntArray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Scatter ``[n, num_heads, head_dim]`` keys and values into distinct ``slots``: one
        indexed copy per pool (K, V) for the whole batch."""
        config = self._config
        slot_index = self._index(slots)
        with torch.no_grad():
            for kv, data in ((0, keys), (1, values)):
                cache = self._pool[layer, kv]
                if config.kv_layout == "NHD":  # [blocks * bs, H, D]: a slot is a row
                    cache.flatten(0, 1).index_copy_(0, slot_index, data)
                elif config.kv_layout == "heads_first":  # [H, blocks * bs, D]
                    cache.flatten(1, 2).index_copy_(1, slot_index, data.transpose(0, 1))
                else:  # HND [blocks, H, bs, D], written through its [blocks, bs, H, D] view
                    blocks = torch.div(slot_index, config.block_size, rounding_mode="floor")
                    offsets = slot_index - blocks * config.block_size
                    cache.transpose(1, 2).index_put_((blocks, offsets), data)

    def gather(self, layer: int, blocks: IntArray, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[num_tokens, num_heads, head_dim]`` copies of the tokens in ``blocks``."""
        index = self._index(blocks)
        return self._tokens(self._pool[layer, 0], index, num_tokens), self._tokens(
            self._pool[layer, 1], index, num_tokens
        )

    def _tokens(self, cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        heads, dim = self._config.num_heads, self._config.head_dim
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
        picked = self._pool.index_select(self._block_axis, self._index(source))
        self._pool.index_copy_(self._block_axis, self._index(destination), picked)

    def blocks_to_host(self, blocks: IntArray) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """Host copies ``[num_layers, n, block_size, num_heads, head_dim]`` of keys and values
        (float32 for a bfloat16 pool; through pinned memory on CUDA)."""
        picked = self._to_canonical(self._pool.index_select(self._block_axis, self._index(blocks)))
        return self._host_copy(picked[:, 0]), self._host_copy(picked[:, 1])

    def blocks_from_host(self, blocks: IntArray, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
        """Write copies made by :meth:`blocks_to_host` back into ``blocks``.

        Raises:
            ShapeMismatchError: arrays not ``[num_layers, len(blocks), block_size, num_heads, head_dim]``.
            DTypeMismatchError: arrays of another dtype than :meth:`blocks_to_host` gives.
        """
        config = self._config
        expected = (config.num_layers, len(blocks), config.block_size, config.num_heads, config.head_dim)
        host_name = dtype_name(self._host_dtype)
        for name, array in (("keys", keys), ("values", values)):
            if not isinstance(array, np.ndarray):
                raise ArrayTypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
            if tuple(array.shape) != expected:
                raise ShapeMismatchError(
                    f"{name} must have shape {expected} ([layers, blocks, block_size, heads, dim]), "
                    f"got {tuple(array.shape)}"
                )
            if array.dtype != np.dtype(host_name):
                raise DTypeMismatchError(
                    f"host {name} have dtype {array.dtype}, the pool's host copies are {host_name}"
                )
        stacked = torch.stack([self._from_host(keys), self._from_host(values)], dim=1)  # [L, 2, n, bs, H, D]
        if config.kv_layout == "HND":
            stacked = stacked.transpose(3, 4)
        elif config.kv_layout == "heads_first":
            stacked = stacked.permute(0, 1, 4, 2, 3, 5)
        self._pool.index_copy_(self._block_axis, self._index(blocks), stacked)

    def _to_canonical(self, picked: torch.Tensor) -> torch.Tensor:
        """``[L, 2, *layout over n blocks]`` -> ``[L, 2, n, block_size, heads, dim]`` (a view)."""
        if self._config.kv_layout == "HND":  # [L, 2, n, H, bs, D]
            return picked.transpose(3, 4)
        if self._config.kv_layout == "heads_first":  # [L, 2, H, n, bs, D]
            return picked.permute(0, 1, 3, 4, 2, 5)
        return picked

    def _host_copy(self, tensor: torch.Tensor) -> npt.NDArray[Any]:
        """A contiguous host NumPy copy (float32 for bfloat16), through pinned memory on CUDA."""
        converted = tensor.to(self._host_dtype)
        if self._device.type == "cpu":
            host = converted.contiguous()  # ``tensor`` is a fresh copy already, never the pool
        else:
            host = torch.empty(tuple(tensor.shape), dtype=self._host_dtype, pin_memory=True)
            host.copy_(converted, non_blocking=True)
            torch.cuda.synchronize(self._device)
        return host.numpy()

    def _from_host(self, array: npt.NDArray[Any]) -> torch.Tensor:
        """A host array on the pool's device in the pool's dtype (through pinned memory on CUDA)."""
        tensor = _tensor_of(np.ascontiguousarray(array))
        if self._device.type != "cpu":
            tensor = tensor.pin_memory().to(self._device, non_blocking=True)
        return tensor.to(self._dtype)

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
        manager), with the attention features of :mod:`kvcache_core.attention_features`."""
        return attend_pool(
            query,
            self._pool[layer, 0],
            self._pool[layer, 1],
            page_table,
            qo_indptr,
            scale,
            causal,
            self._config.layout,
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
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
            tensor = _tensor_of(array)
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
        target = HOST_DTYPES.get(tensor.dtype, tensor.dtype)
        return tensor.to(device="cpu", dtype=target).numpy()

    def array_namespace(self) -> Any:
        """The Array API namespace of torch tensors (``array_api_compat.torch``)."""
        import array_api_compat.torch

        return array_api_compat.torch

    def __repr__(self) -> str:
        config = self._config
        return (
            f"TorchStorage(layers={config.num_layers}, blocks={config.num_blocks}x{config.block_size}, "
            f"heads={config.num_heads}, head_dim={config.head_dim}, dtype={config.dtype}, "
            f"layout={config.kv_layout}, device={self._device})"
        )
