"""Per-call attention features: a layer's sliding window, logit softcapping, attention
sinks and chunked local attention, their checks and the capabilities that claim them.

Each is a keyword argument of every paged attention (the NumPy reference, the compiled
CPU kernel, the torch and JAX backends, :meth:`PagedKvCacheManager.paged_attention` and
:meth:`Step.attention`), given per call, so per layer:

* ``window=W``: the query at position ``p`` sees keys ``k`` with ``p - W < k`` (its last
  ``W`` tokens, itself included). A pool's ``sliding_window`` (carried by the page table)
  applies too: the query sees the keys both windows admit (the smaller window).
* ``softcap=cap``: every score ``s`` (already scaled) becomes ``tanh(s / cap) * cap``
  before the mask (Gemma 2).
* ``sinks``: ``[num_query_heads]`` learned logits, one per query head, that join the
  softmax's denominator and contribute no value (gpt-oss): the weights of a row are
  ``exp(s_k) / (exp(sink) + sum_k exp(s_k))``. A sink is not scaled or capped; it must
  be finite (a NaN or infinite sink makes every output of its head NaN).
* ``chunk=C``: the query at position ``p`` sees keys in its own chunk only,
  ``k // C == p // C`` (with ``causal``, ``[p // C * C, p]``; Llama 4). Positions are
  absolute, so a page table of a pool with a sliding window (which lists a request from
  its first held block) cannot be attended with a chunk.

Every backend represents the same values: ``window`` and ``chunk`` are ints from 1 to
``INT32_MAX`` (positions are int32), ``softcap`` (like the score ``scale``) a normal
float32 (larger ones overflow to infinity, smaller ones vanish to 0); NumPy integers and
floats are accepted and handed to the storage as Python's.

A backend's storage serves a feature only if it says so: its optional member
``attention_features``, a frozenset of the capability names below, which its
``BackendSpec.capabilities`` claim too (the conformance kit checks they agree and runs
the feature's cases). The manager never calls a storage with a feature it does not list:
it refuses with :class:`~kvcache_core.errors.UnsupportedConfigError` naming the capability.
"""

from __future__ import annotations

from typing import Any, Final, Protocol, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.hookspecs import ATTENTION_CAPABILITIES
from kvcache_core.contract.scalars import INT32_MAX, check_optional_count, check_positive_float32
from kvcache_core.errors import InvalidArgumentError, InvalidTypeError, UnsupportedConfigError

__all__ = [
    "ATTENTION_CAPABILITIES",
    "FEATURE_CAPABILITIES",
    "ArrayCheck",
    "check_attention_features",
    "check_chunk",
    "check_chunk_positions",
    "check_finite_logits",
    "check_softcap",
    "check_window",
    "combined_window",
    "storage_attention_features",
    "visible_key_range",
]

#: The keyword argument of each feature -> the capability that claims it (one of
#: :data:`~kvcache_core.contract.hookspecs.ATTENTION_CAPABILITIES`, re-exported here).
FEATURE_CAPABILITIES: Final[dict[str, str]] = {
    "window": "attention_window",
    "softcap": "softcap",
    "sinks": "sinks",
    "chunk": "chunked_attention",
}


class ArrayCheck(Protocol):
    """Checks a native array against the pool: ``(name, array, expected_shape)``, its shape
    and dtype (the pool's compute dtype); with ``finite=True`` also that every value is
    finite."""

    def __call__(self, name: str, array: object, expected: tuple[int, ...], *, finite: bool = False) -> None: ...


def check_window(window: object, name: str = "window") -> int | None:
    """``window`` as an ``int`` if it is ``None`` or an int (Python or NumPy) from 1 to
    ``INT32_MAX``.

    Raises:
        InvalidArgumentError: anything else; the message names ``name`` and the range.
    """
    return check_optional_count(window, name, 1, INT32_MAX)


def check_chunk(chunk: object) -> int | None:
    """``chunk`` as an ``int`` if it is ``None`` or an int (Python or NumPy) from 1 to
    ``INT32_MAX``.

    Raises:
        InvalidArgumentError: anything else; the message names the range.
    """
    return check_optional_count(chunk, "chunk", 1, INT32_MAX)


def check_softcap(softcap: object) -> float | None:
    """``softcap`` as a ``float`` if it is ``None`` or a finite number > 0 that float32
    holds as a normal number.

    Raises:
        InvalidArgumentError: anything else; the message names the range.
    """
    if softcap is None:
        return None
    return check_positive_float32(softcap, "softcap", optional=True)


def check_finite_logits(name: str, logits: npt.NDArray[Any]) -> None:
    """Refuse logits (a host copy of ``sinks``) that are not all finite.

    Raises:
        InvalidArgumentError: naming the first NaN or infinite element.
    """
    flat = np.asarray(logits, dtype=np.float64).reshape(-1)
    finite = np.isfinite(flat)
    if not finite.all():
        index = int(np.argmin(finite))
        raise InvalidArgumentError(
            f"{name}[{index}] = {float(flat[index])!r}: {name} must be finite logits "
            "(a NaN or infinite one makes its head's output NaN)"
        )


def visible_key_range(
    query_positions: npt.ArrayLike,
    num_keys: int,
    *,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The keys each query sees, as ranges ``[low, high)`` of key positions ``0 .. num_keys - 1``:
    each rule narrows the range of the query at ``p``: ``causal`` to ``k <= p``, ``window``
    ``W`` to ``p - W < k``, ``chunk`` ``C`` to its own chunk ``[p // C * C, (p // C + 1) * C)``.

    Args:
        query_positions: the queries' absolute positions (any shape).
        num_keys: the keys' count (positions ``0 .. num_keys - 1``).
        causal, window, chunk: the rules to apply (checked values, see the module docstring).

    Returns:
        ``(low, high)``, int64 arrays of ``query_positions``' shape; ``low >= high`` where a
        query sees no key.
    """
    positions = np.asarray(query_positions, dtype=np.int64)
    low = np.zeros_like(positions)
    high = np.full_like(positions, num_keys)
    if causal:
        high = np.minimum(high, positions + 1)
    if window is not None:
        low = np.maximum(low, positions - window + 1)
    if chunk is not None:
        chunk_start = positions // chunk * chunk
        low = np.maximum(low, chunk_start)
        high = np.minimum(high, chunk_start + chunk)
    return low, high


def combined_window(window: int | None, table_window: int | None) -> int | None:
    """The window a query sees through: the smaller of the call's and the page table's
    (``None`` when neither has one)."""
    if window is None:
        return table_window
    if table_window is None:
        return window
    return min(window, table_window)


def check_chunk_positions(chunk: int | None, table_window: int | None) -> None:
    """Refuse a chunk over a page table whose positions are relative (a pool window).

    Raises:
        InvalidArgumentError: ``chunk`` is set and the page table has a sliding window.
    """
    if chunk is not None and table_window is not None:
        raise InvalidArgumentError(
            f"chunk={chunk} needs absolute positions, but the page table (sliding_window={table_window}) lists "
            "each request from its first held block; use window= on a pool without sliding_window"
        )


def storage_attention_features(storage: object) -> frozenset[str]:
    """The attention capabilities a storage serves: its optional ``attention_features``
    (names of :data:`ATTENTION_CAPABILITIES`), empty when it has none.

    Raises:
        InvalidTypeError: ``attention_features`` is not a set of capability names.
    """
    features: object = getattr(storage, "attention_features", frozenset[str]())
    if isinstance(features, frozenset) and features <= ATTENTION_CAPABILITIES:  # the usual case, per call
        return cast("frozenset[str]", features)
    if not isinstance(features, (set, frozenset)):
        raise InvalidTypeError(
            f"{type(storage).__name__}.attention_features must be a frozenset of "
            f"{sorted(ATTENTION_CAPABILITIES)}, got {features!r}"
        )
    names = frozenset(str(name) for name in features)  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
    unknown = names - ATTENTION_CAPABILITIES
    if unknown:
        raise InvalidTypeError(
            f"{type(storage).__name__}.attention_features names {sorted(unknown)}; known: {sorted(ATTENTION_CAPABILITIES)}"
        )
    return names


def check_attention_features(
    *,
    window: object,
    softcap: object,
    sinks: object,
    chunk: object,
    served: frozenset[str],
    backend: str,
    query_heads: int,
    table_window: int | None,
    check_array: ArrayCheck,
) -> dict[str, Any]:
    """Check a call's attention features; the keyword arguments to hand the storage (only
    the features that are set, so a storage serving none is called as before).

    Args:
        window, softcap, sinks, chunk: the call's arguments (see the module docstring).
        served: the capabilities the storage serves (:func:`storage_attention_features`).
        backend: the backend's name, for messages.
        query_heads: the query's heads (``sinks`` has one entry each).
        table_window: the page table's sliding window.
        check_array: ``(name, array, expected_shape, finite=...)`` checks a native array's
            shape and dtype (the pool's, which is the query's) and, ``finite``, its values.

    Raises:
        InvalidArgumentError: a window or chunk that is not an int from 1 to ``INT32_MAX``,
            a softcap that is not a normal float32 > 0, non-finite sinks, a chunk over a
            page table with a sliding window.
        ShapeMismatchError, DTypeMismatchError, ArrayTypeError: ``sinks`` is not a
            ``[query_heads]`` native array of the query's dtype.
        UnsupportedConfigError: a feature whose capability the storage does not serve.
    """
    keywords: dict[str, Any] = {}
    if window is None and softcap is None and sinks is None and chunk is None:
        return keywords
    checked_window = check_window(window)
    if checked_window is not None:
        keywords["window"] = checked_window
    checked_softcap = check_softcap(softcap)
    if checked_softcap is not None:
        keywords["softcap"] = checked_softcap
    checked_chunk = check_chunk(chunk)
    check_chunk_positions(checked_chunk, table_window)
    if checked_chunk is not None:
        keywords["chunk"] = checked_chunk
    if sinks is not None:
        keywords["sinks"] = sinks
    for keyword in keywords:
        capability = FEATURE_CAPABILITIES[keyword]
        if capability not in served:
            raise UnsupportedConfigError(
                f"backend {backend!r} does not serve {keyword}= (capability {capability!r}): its storage's "
                f"attention_features are {sorted(served)}"
            )
    if sinks is not None:  # after the capabilities: its values are read through a host copy
        check_array("sinks", sinks, (query_heads,), finite=True)
    return keywords
