"""Where a pool lives: :class:`Device`, parsed from and printed as ``"cpu"``, ``"cuda:0"``, ..."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_core.contract.scalars import INT32_MAX, check_optional_count, shown
from kvcache_core.errors import InvalidArgumentError

__all__ = ["DEVICE_KINDS", "Device"]

#: Device kinds understood by :meth:`Device.parse`. Backends say which of them they support.
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "mps", "xpu", "tpu", "gpu")


@dataclass(frozen=True, slots=True)
class Device:
    """A device kind and an optional index: ``Device("cuda", 0)`` prints as ``"cuda:0"``.

    ``index=None`` means the library's default device of that kind (``"cuda"``); an index
    is stored as an ``int`` (NumPy integers are accepted) from 0 to ``INT32_MAX``.

    Raises:
        InvalidArgumentError: unknown kind, or an index that is not an int in that range.
    """

    kind: str = "cpu"
    index: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            object.__setattr__(self, "kind", str(self.kind))  # NumPy's str_ as a plain str
        if self.kind not in DEVICE_KINDS:
            raise InvalidArgumentError(
                f"unknown device kind {shown(self.kind)}; valid kinds: {', '.join(DEVICE_KINDS)}"
            )
        object.__setattr__(self, "index", check_optional_count(self.index, "device index", 0, INT32_MAX))

    @classmethod
    def parse(cls, text: str | Device) -> Device:
        """Parse ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... (a :class:`Device` is returned as is).

        Raises:
            InvalidArgumentError: the text is not ``kind`` or ``kind:index``.
        """
        if isinstance(text, Device):
            return text
        if not isinstance(text, str):
            raise InvalidArgumentError(f"device must be a str or Device, got {shown(text)}")
        kind, sep, index_text = text.strip().lower().partition(":")
        if not sep:
            return cls(kind)
        if not (index_text.isascii() and index_text.isdigit() and len(index_text) <= len(str(INT32_MAX))):
            raise InvalidArgumentError(
                f"bad device {shown(text)}: the index after ':' must be a whole number from 0 to {INT32_MAX}"
            )
        return cls(kind, int(index_text))

    @property
    def is_cpu(self) -> bool:
        """Whether this is host memory."""
        return self.kind == "cpu"

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"
