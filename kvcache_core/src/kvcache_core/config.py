"""Value types that configure a cache and ask for one: :class:`CacheConfig`, :class:`AllocationRequest`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypeGuard

from kvcache_core.device import Device
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, LayerIndexError

__all__ = ["DTYPE_SIZES", "KV_LAYOUTS", "AllocationRequest", "CacheConfig"]

#: Bytes per element of every dtype name a backend may claim.
DTYPE_SIZES: Final[dict[str, int]] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

#: Pool layouts. ``"NHD"`` is ``[num_blocks, block_size, num_heads, head_dim]`` (vLLM,
#: FlashInfer); ``"HND"`` is ``[num_blocks, num_heads, block_size, head_dim]``;
#: ``"heads_first"`` is ``[num_heads, num_blocks, block_size, head_dim]`` (JAX Pallas).
KV_LAYOUTS: Final[tuple[str, ...]] = ("NHD", "HND", "heads_first")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        error = InvalidConfigError if owner == "CacheConfig" else InvalidArgumentError
        raise error(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True, init=False)
class CacheConfig:
    """Geometry and policy of one paged pool.

    Attributes:
        num_layers: transformer layers cached (>= 1).
        num_heads: KV heads per layer (>= 1); query heads may be a multiple (GQA).
        head_dim: features per head (>= 1).
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block (>= 1), 16 by default.
        dtype: element type of the pool, a key of :data:`DTYPE_SIZES`.
        device: where the pool lives; a :class:`Device` or its text (``"cuda:0"``).
        kv_layout: pool layout, one of :data:`KV_LAYOUTS`.
        enable_prefix_caching: share full prompt blocks between requests.
        sliding_window: tokens each query attends to, or ``None`` for all.
        medium_pressure_threshold, high_pressure_threshold, critical_pressure_threshold:
            fractions of the pool in use at which :class:`MemoryPressure` rises;
            ``0 < medium < high < critical <= 1``.

    Raises:
        InvalidConfigError: any field out of its range; the message names it.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: str = "float32"
    device: Device = field(default_factory=Device)
    kv_layout: str = "NHD"
    enable_prefix_caching: bool = False
    sliding_window: int | None = None
    medium_pressure_threshold: float = 0.6
    high_pressure_threshold: float = 0.8
    critical_pressure_threshold: float = 0.95

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: str = "float32",
        device: Device | str = "cpu",
        kv_layout: str = "NHD",
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        medium_pressure_threshold: float = 0.6,
        high_pressure_threshold: float = 0.8,
        critical_pressure_threshold: float = 0.95,
    ) -> None:
        # Written out so that ``device`` accepts its text form ("cuda:0") and is stored as
        # a Device; the dataclass still provides eq, repr, hash and replace().
        values = dict(locals())
        del values["self"]
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "num_blocks", "block_size"):
            _require_int("CacheConfig", name, getattr(self, name), 1)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise InvalidConfigError(f"CacheConfig.dtype {self.dtype!r} is unknown; valid: {', '.join(DTYPE_SIZES)}")
        try:
            object.__setattr__(self, "device", Device.parse(self.device))
        except InvalidArgumentError as exc:
            raise InvalidConfigError(f"CacheConfig.device: {exc}") from exc
        if not isinstance(self.kv_layout, str) or self.kv_layout not in KV_LAYOUTS:
            raise InvalidConfigError(
                f"CacheConfig.kv_layout {self.kv_layout!r} is unknown; valid: {', '.join(KV_LAYOUTS)}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidConfigError(
                f"CacheConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.sliding_window is not None:
            _require_int("CacheConfig", "sliding_window", self.sliding_window, 1)
        thresholds = (
            self.medium_pressure_threshold,
            self.high_pressure_threshold,
            self.critical_pressure_threshold,
        )
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in thresholds) or not (
            0.0 < thresholds[0] < thresholds[1] < thresholds[2] <= 1.0
        ):
            raise InvalidConfigError(
                "pressure thresholds must satisfy 0 < medium < high < critical <= 1, got "
                f"medium={thresholds[0]!r}, high={thresholds[1]!r}, critical={thresholds[2]!r}"
            )

    def check_layer(self, layer: object) -> int:
        """``layer`` as an int, if ``0 <= layer < num_layers`` (NumPy integers accepted).

        Raises:
            LayerIndexError: anything else; the message names the value and the range.
        """
        index = int(layer) if isinstance(layer, numbers.Integral) and not isinstance(layer, bool) else -1
        if not 0 <= index < self.num_layers:
            raise LayerIndexError(f"layer {layer!r} is out of range: valid layers are 0 to {self.num_layers - 1}")
        return index

    @property
    def dtype_size(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in the pool: keys and values of every layer."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * self.dtype_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in the pool: ``block_size`` tokens of every layer, K and V."""
        return self.block_size * self.bytes_per_token

    @property
    def total_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one layer's key (or value) pool in :attr:`kv_layout`."""
        blocks, tokens, heads, dim = self.num_blocks, self.block_size, self.num_heads, self.head_dim
        if self.kv_layout == "NHD":
            return (blocks, tokens, heads, dim)
        if self.kv_layout == "HND":
            return (blocks, heads, tokens, dim)
        return (heads, blocks, tokens, dim)


@dataclass(frozen=True, slots=True)
class AllocationRequest:
    """What a new request asks of the manager.

    Attributes:
        request_id: a non-empty id, unique among live requests.
        initial_tokens: tokens to reserve blocks for at once (>= 0); the sequence itself
            starts empty and grows with :meth:`KvCacheManager.extend`.
        max_sequence_length: the most tokens this request will ever hold, or ``None`` if
            unknown; when given, the allocator keeps room after the request's blocks so it
            grows as one run, and ``extend`` refuses to go past it.
        prompt_token_ids: the prompt's token ids (used by prefix caching).
        priority: larger is more important; recorded on the handle.

    Raises:
        InvalidArgumentError: a field out of its range; the message names it.
    """

    request_id: str
    initial_tokens: int = 0
    max_sequence_length: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(f"AllocationRequest.request_id must be a non-empty str, got {self.request_id!r}")
        _require_int("AllocationRequest", "initial_tokens", self.initial_tokens, 0)
        if self.max_sequence_length is not None:
            _require_int("AllocationRequest", "max_sequence_length", self.max_sequence_length, 1)
            if self.initial_tokens > self.max_sequence_length:
                raise InvalidArgumentError(
                    f"AllocationRequest.initial_tokens={self.initial_tokens} exceeds "
                    f"max_sequence_length={self.max_sequence_length}"
                )
        if self.prompt_token_ids is not None:
            tokens: object = self.prompt_token_ids
            if (
                not isinstance(tokens, Sequence)
                or isinstance(tokens, (str, bytes))
                or not all(_is_int(t) and t >= 0 for t in tokens)
            ):
                raise InvalidArgumentError("AllocationRequest.prompt_token_ids must be a sequence of ints >= 0")
            object.__setattr__(self, "prompt_token_ids", tuple(tokens))  # pyright: ignore[reportUnknownArgumentType]
        if not _is_int(self.priority):
            raise InvalidArgumentError(f"AllocationRequest.priority must be an int, got {self.priority!r}")
