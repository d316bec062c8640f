"""JSON read from outside the process, parsed strictly: bounded nesting (checked before
parsing, so no input can exhaust the stack), no ``NaN`` or infinities, no duplicate keys,
and every refusal one library error.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import numpy as np

from kvcache_core.errors import KvCacheError

__all__ = ["MAX_JSON_DEPTH", "json_depth", "parse_json"]

#: The deepest nesting of arrays and objects accepted by default (kvcache's own documents
#: nest at most 4 deep).
MAX_JSON_DEPTH = 32

# A JSON string, escapes included; one never closed runs to the end of the text, so every
# quote starts a match and removing strings takes linear time whatever the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_OPENING = np.frombuffer(b"[{", dtype=np.uint8)
_CHUNK = 1 << 20
_OPENING_CODES = frozenset(b"[{")
#: Brackets counted by a plain loop (fewer than NumPy needs to pay off).
_SHORT = 512


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON document ``text``, counted
    without recursion, in time linear in its length and memory bounded by it. (For text
    that is not JSON: at least the depth a parser reaches before it finds the error.)"""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    depth = deepest = 0
    if len(brackets) <= _SHORT:  # a short document: a plain loop beats NumPy's set-up
        for code in brackets:
            depth += 1 if code in _OPENING_CODES else -1
            deepest = max(deepest, depth)
        return deepest
    for start in range(0, len(brackets), _CHUNK):
        codes = np.frombuffer(brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - start), offset=start)
        running = np.cumsum(np.where(np.isin(codes, _OPENING), 1, -1), dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def parse_json(text: str | bytes, *, what: str, error: type[KvCacheError], max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The value of the JSON document ``text``, parsed strictly.

    Args:
        text: the document (``bytes`` must be UTF-8).
        what: what it is, for messages (``"'cache.safetensors': the header"``).
        error: the library error to raise (it takes one message).
        max_depth: the deepest nesting of arrays and objects accepted.

    Raises:
        error: ``text`` is not UTF-8 or not JSON, nests deeper than ``max_depth``, has a
            ``NaN``, an infinity (``1e400`` included) or an integer of more than 4300
            digits, or an object with a key twice.
    """

    def refuse(reason: str) -> NoReturn:
        raise error(f"{what} is not valid JSON: {reason}")

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            refuse(f"not UTF-8 ({exc.reason} at byte {exc.start})")
    depth = json_depth(text)
    if depth > max_depth:
        refuse(f"it nests {depth} deep, at most {max_depth} is accepted")

    def constant(name: str) -> NoReturn:
        refuse(f"{name} is not a number JSON allows")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            refuse(f"{literal[:40]} is out of the range of a float")
        return value

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    refuse(f"an object has the key {key[:80]!r} twice")
                seen.add(key)
        return result

    try:
        return json.loads(text, parse_constant=constant, parse_float=finite, object_pairs_hook=unique)
    except KvCacheError:
        raise
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, an int past 4300 digits
        refuse(str(exc)[:200])
