"""What a new request asks of the manager: :class:`AllocationRequest`, and the token-id rule
every caller shares (:func:`check_token_ids`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.scalars import INT32_MAX, IntLike, as_integer, check_count, shown
from kvcache_core.errors import InvalidArgumentError

__all__ = ["MAX_TOKEN_ID", "AllocationRequest", "check_token_ids", "store_fields"]

#: The largest token id accepted (token ids are hashed as 64-bit integers).
MAX_TOKEN_ID: Final = 2**63 - 1


def check_token_ids(value: object, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of token ids, if it is a sequence (or 1-D integer array) of
    ints in ``[0, MAX_TOKEN_ID]``.

    Raises:
        InvalidArgumentError: anything else; the message names ``name``, the first bad
            element and the valid range.
    """
    if isinstance(value, np.ndarray):
        array = cast("npt.NDArray[Any]", value)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise InvalidArgumentError(
                f"{name} must be a 1-D integer array, got dtype {array.dtype} shape {array.shape}"
            )
        value = array.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"{name} must be a sequence of ints in [0, {MAX_TOKEN_ID}], got {shown(value)}")
    items: list[object] = list(cast("Iterable[object]", value))
    if items and set(map(type, items)) == {int}:  # plain ints (the common case): checked at C speed
        plain = cast("list[int]", items)
        if min(plain) >= 0 and max(plain) <= MAX_TOKEN_ID:
            return tuple(plain)
    checked: list[int] = []
    for index, item in enumerate(items):
        token = as_integer(item)
        if token is None or not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"{name}[{index}] = {shown(item)} is not a token id: valid ids are ints in [0, {MAX_TOKEN_ID}]"
            )
        checked.append(token)
    return tuple(checked)


def store_fields(instance: Any, arguments: dict[str, Any]) -> None:
    """Set a frozen dataclass's fields from its written-out ``__init__``'s arguments
    (``locals()``), then run its ``__post_init__``, which checks and normalizes them."""
    for name, value in arguments.items():
        if name != "self":
            object.__setattr__(instance, name, value)
    instance.__post_init__()


@dataclass(frozen=True, slots=True, init=False)
class AllocationRequest:
    """What a new request asks of the manager.

    Attributes:
        request_id: a non-empty id, unique among live requests.
        initial_tokens: tokens to reserve blocks for at once (>= 0); the sequence itself
            starts empty and grows with :meth:`KvCacheManager.extend`.
        max_sequence_length: the most tokens this request will ever hold, or ``None`` if
            unknown; when given, the allocator keeps room after the request's blocks so it
            grows as one run, and ``extend`` refuses to go past it.
        prompt_token_ids: the prompt's token ids, ints in ``[0, MAX_TOKEN_ID]`` (a sequence or
            a 1-D integer NumPy array); stored as a tuple. With prefix caching, ``allocate`` maps
            the cached full blocks of the prompt, and the prompt's later blocks become
            cacheable once written.
        priority: larger is more important; recorded on the handle.
        cache_salt: ``str`` or ``bytes`` mixed into every block hash of this request, so
            requests with different salts (tenants) never share cached blocks; ``None`` for
            no salt. A ``str`` is hashed as its UTF-8 bytes.

    Fields are stored as plain Python values (NumPy integers and strings are accepted and
    converted); ``initial_tokens`` and ``max_sequence_length`` are at most ``INT32_MAX``.

    Raises:
        InvalidArgumentError: a field out of its range; the message names it.
    """

    request_id: str
    initial_tokens: int = 0
    max_sequence_length: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    priority: int = 0
    cache_salt: str | bytes | None = None

    def __init__(
        self,
        request_id: str,
        initial_tokens: IntLike = 0,
        max_sequence_length: IntLike | None = None,
        prompt_token_ids: Sequence[IntLike] | npt.NDArray[np.integer[Any]] | None = None,
        priority: IntLike = 0,
        cache_salt: str | bytes | None = None,
    ) -> None:
        # Written out so that NumPy integers and arrays type-check; stored as Python values.
        store_fields(self, locals())

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"AllocationRequest.request_id must be a non-empty str, got {shown(self.request_id)}"
            )
        object.__setattr__(self, "request_id", str(self.request_id))
        initial = check_count(self.initial_tokens, "AllocationRequest.initial_tokens", 0, INT32_MAX)
        object.__setattr__(self, "initial_tokens", initial)
        if self.max_sequence_length is not None:
            longest = check_count(self.max_sequence_length, "AllocationRequest.max_sequence_length", 1, INT32_MAX)
            object.__setattr__(self, "max_sequence_length", longest)
            if self.initial_tokens > self.max_sequence_length:
                raise InvalidArgumentError(
                    f"AllocationRequest.initial_tokens={self.initial_tokens} exceeds "
                    f"max_sequence_length={self.max_sequence_length}"
                )
        if self.prompt_token_ids is not None:
            tokens = check_token_ids(self.prompt_token_ids, "AllocationRequest.prompt_token_ids")
            if self.max_sequence_length is not None and len(tokens) > self.max_sequence_length:
                raise InvalidArgumentError(
                    f"AllocationRequest.prompt_token_ids holds {len(tokens)} tokens, more than "
                    f"max_sequence_length={self.max_sequence_length}"
                )
            object.__setattr__(self, "prompt_token_ids", tokens)
        priority = as_integer(self.priority)
        if priority is None:
            raise InvalidArgumentError(f"AllocationRequest.priority must be an int, got {shown(self.priority)}")
        object.__setattr__(self, "priority", priority)
        if self.cache_salt is not None and not isinstance(self.cache_salt, (str, bytes)):
            raise InvalidArgumentError(
                f"AllocationRequest.cache_salt must be a str, bytes or None, got {type(self.cache_salt).__name__} "
                f"{self.cache_salt!r}"
            )
        if self.cache_salt is not None:  # NumPy's str_ and bytes_ as plain str and bytes
            plain = str(self.cache_salt) if isinstance(self.cache_salt, str) else bytes(self.cache_salt)
            object.__setattr__(self, "cache_salt", plain)
        if isinstance(self.cache_salt, str):
            try:
                self.cache_salt.encode()
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(
                    f"AllocationRequest.cache_salt {self.cache_salt!r} cannot be encoded as UTF-8: {exc.reason}"
                ) from exc

    def salt_bytes(self) -> bytes | None:
        """:attr:`cache_salt` as the bytes that are hashed (UTF-8 for a ``str``)."""
        salt = self.cache_salt
        return salt.encode() if isinstance(salt, str) else salt
