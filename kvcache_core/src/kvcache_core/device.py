"""Where a pool lives: :class:`Device`, parsed from and printed as ``"cpu"``, ``"cuda:0"``, ..."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_core.errors import InvalidArgumentError

__all__ = ["DEVICE_KINDS", "Device"]

#: Device kinds understood by :meth:`Device.parse`. Backends say which of them they support.
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "mps", "xpu", "tpu", "gpu")


@dataclass(frozen=True, slots=True)
class Device:
    """A device kind and an optional index: ``Device("cuda", 0)`` prints as ``"cuda:0"``.

    ``index=None`` means the library's default device of that kind (``"cuda"``).

    Raises:
        InvalidArgumentError: unknown kind, or a negative index.
    """

    kind: str = "cpu"
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise InvalidArgumentError(f"unknown device kind {self.kind!r}; valid kinds: {', '.join(DEVICE_KINDS)}")
        if self.index is not None and (
            isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0
        ):
            raise InvalidArgumentError(f"device index must be an int >= 0 or None, got {self.index!r}")

    @classmethod
    def parse(cls, text: str | Device) -> Device:
        """Parse ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... (a :class:`Device` is returned as is).

        Raises:
            InvalidArgumentError: the text is not ``kind`` or ``kind:index``.
        """
        if isinstance(text, Device):
            return text
        if not isinstance(text, str):
            raise InvalidArgumentError(f"device must be a str or Device, got {text!r}")
        kind, sep, index_text = text.strip().lower().partition(":")
        if not sep:
            return cls(kind)
        if not (index_text.isascii() and index_text.isdigit()):
            raise InvalidArgumentError(f"bad device {text!r}: the index after ':' must be a whole number >= 0")
        return cls(kind, int(index_text))

    @property
    def is_cpu(self) -> bool:
        """Whether this is host memory."""
        return self.kind == "cpu"

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"
