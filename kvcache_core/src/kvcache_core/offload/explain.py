"""Explainable prefix hits: where each block of a prompt's prefix is — the pool, which offload
tier — and why its chain stops (``manager.explain_prefix`` and ``kvcache explain``).

A prompt's full blocks are hashed as a new request's would be (namespace, salt, block size);
each is looked for in the pool's prefix cache, then in each tier (one round trip for a tier
that looks ahead, :class:`~kvcache_core.offload.redis_tier.RedisTier`). The chain stops at the
first block found nowhere, and the reason is the most specific one found:

* ``"end of prompt"``: every full block is cached; the tokens left do not fill a block (the
  last prompt token is always computed).
* ``"hash collision"``: the pool holds the hash for other tokens.
* ``"other salt"``: the pool holds this prefix under another salt (or none), or a shared
  store holds it without the salt when one was given.
* ``"block size mismatch"``: a shared store holds this prefix in records of another block size
  (another engine configuration wrote them).
* ``"other geometry"``: a shared store holds records of this namespace for another geometry
  or dtype only.
* ``"other namespace"``: a shared store holds records of other namespaces (``model_id``) only.
* ``"evicted"``: the pool held the block and let it go (known when an :class:`EvictionLog`
  subscribed to the manager is given).
* ``"not cached"``: nothing above: never computed here (or evicted, without a log).
* ``"no state checkpoint"``: a pool with recurrent-state layers holds the blocks past the
  cached tokens, but no state checkpoint at any of them (a hit restarts the states from
  the last checkpoint held, in the pool or a tier).

Looking never changes what is cached (no recency is touched, nothing is promoted).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvcache_core.contract.config import AllocationRequest, check_token_ids
from kvcache_core.contract.scalars import check_count
from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.offload.events import POOL_MEDIUM, BlockRemoved, BlockStored, CacheEvent
from kvcache_core.offload.redis_tier import namespace_part, record_format_tag
from kvcache_core.paging.prefix import PrefixEntry, hash_block, namespace_root

if TYPE_CHECKING:
    from kvcache_core.contract.config import CacheConfig
    from kvcache_core.offload.tier_stack import TierChain
    from kvcache_core.paging.block_pool import BlockPool

__all__ = ["REASONS", "BlockPlace", "EvictionLog", "PrefixExplanation", "explain_prefix"]

#: Every reason a chain stops, most specific first (see the module docstring; the last one
#: cuts a chain found further back to its last state checkpoint).
REASONS = (
    "end of prompt",
    "hash collision",
    "other salt",
    "block size mismatch",
    "other geometry",
    "other namespace",
    "evicted",
    "not cached",
    "no state checkpoint",
)
#: The block sizes tried when a shared store holds records of another geometry.
_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class BlockPlace:
    """Where one full block of the prompt is.

    Attributes:
        index: the block's place in the prompt (tokens ``index * block_size`` on).
        block_hash: its hash. medium: ``"pool"``, a tier's name, or ``None`` (nowhere).
    """

    index: int
    block_hash: bytes
    medium: str | None


@dataclass(frozen=True, slots=True)
class PrefixExplanation:
    """Where a prompt's prefix is and why it stops.

    Attributes:
        blocks: the full blocks walked, in order, up to and including the first found
            nowhere. cached_tokens: the tokens of the blocks found (a new request with
            this prompt maps or promotes at most these).
        block_size: the pool's. prompt_tokens: the prompt's length.
        reason: one of :data:`REASONS`. detail: a sentence saying more.
    """

    blocks: tuple[BlockPlace, ...]
    cached_tokens: int
    block_size: int
    prompt_tokens: int
    reason: str
    detail: str

    def __str__(self) -> str:
        lines = [f"{'block':>5}  {'tokens':<13}  {'hash':<16}  where"]
        for place in self.blocks:
            start = place.index * self.block_size
            span = f"{start}-{start + self.block_size - 1}"
            lines.append(f"{place.index:>5}  {span:<13}  {place.block_hash.hex()[:16]}  {place.medium or '-'}")
        lines.append(
            f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens cached; the chain stops: "
            f"{self.reason} ({self.detail})"
        )
        return "\n".join(lines)


class EvictionLog:
    """The last ``capacity`` hashes the pool let go and holds no more: subscribe it to a
    manager (``manager.subscribe(log)``) and give it to ``explain_prefix(..., evicted=log)``
    to tell an evicted block from one never computed.

    Raises:
        InvalidArgumentError: ``capacity`` below 1.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = check_count(capacity, "capacity", 1)
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __call__(self, event: CacheEvent) -> None:
        if isinstance(event, BlockRemoved) and event.medium == POOL_MEDIUM:
            for block_hash in event.block_hashes:
                self._hashes[block_hash] = None
                self._hashes.move_to_end(block_hash)
            while len(self._hashes) > self._capacity:
                self._hashes.popitem(last=False)
        elif isinstance(event, BlockStored) and event.medium == POOL_MEDIUM:
            for block_hash in event.block_hashes:
                self._hashes.pop(block_hash, None)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes


def explain_prefix(
    config: CacheConfig,
    prompt_token_ids: Sequence[int],
    salt: str | bytes | None,
    *,
    pool: BlockPool | None,
    tiers: TierChain,
    evicted: EvictionLog | None = None,
) -> PrefixExplanation:
    """Where ``prompt_token_ids``' prefix is in ``pool`` and ``tiers`` and why it stops
    (see the module docstring; ``evicted`` tells the blocks the pool let go). Call with the
    manager's lock held.

    Raises:
        InvalidArgumentError: token ids that are not a sequence of ints in ``[0, MAX_TOKEN_ID]``
            (named as ``explain_prefix``'s), or a bad salt (as ``AllocationRequest``).
    """
    prompt_ids = check_token_ids(prompt_token_ids, "explain_prefix's prompt_token_ids")
    request = AllocationRequest("explain", 0, prompt_token_ids=prompt_ids or None, cache_salt=salt)
    prompt = request.prompt_token_ids or ()
    salt_bytes = request.salt_bytes()
    block_size = config.block_size
    full = (len(prompt) - 1) // block_size if prompt else 0
    hashes = _chain(config.model_id, prompt, block_size, full, salt_bytes)
    if tiers.looks_ahead:
        tiers.prefetch(hashes, salt_bytes)
    prefix = pool.prefix if pool is not None else None
    names = [tier.name for tier in tiers.tiers]
    places: list[BlockPlace] = []
    collision = False
    for index, block_hash in enumerate(hashes):
        medium: str | None = None
        entry = prefix.get(block_hash) if prefix is not None else None
        tokens = tuple(prompt[index * block_size : (index + 1) * block_size])
        if entry is not None and entry.token_ids == tokens and entry.salt == salt_bytes:
            medium = "pool"
        elif entry is not None:
            collision = True
        else:
            level = tiers.holds(block_hash, 0)
            medium = None if level is None else names[level]
        places.append(BlockPlace(index, block_hash, medium))
        if medium is None:
            break
    found = sum(1 for place in places if place.medium is not None)
    served = _checkpointed(pool, tiers, hashes, found)
    if served < found:  # a pool with state layers restarts its states from a checkpoint
        detail = (
            f"blocks {served} to {found - 1} are cached, but no recurrent-state checkpoint is held at any of "
            "them (pool or tier): a hit starts from the last checkpoint"
        )
        return PrefixExplanation(
            tuple(places), served * block_size, block_size, len(prompt), "no state checkpoint", detail
        )
    if found == full:
        left = len(prompt) - found * block_size
        reason, detail = "end of prompt", f"{left} tokens left, a block holds {block_size}; the last is always computed"
    elif collision:
        reason, detail = "hash collision", f"the pool holds block {found}'s hash for other tokens"
    elif evicted is not None and hashes[found] in evicted:
        reason, detail = "evicted", f"the pool held block {found} and let it go; no tier took it"
    else:
        reason, detail = _why_missing(config, prompt, salt_bytes, found, pool, tiers)
    return PrefixExplanation(tuple(places), found * block_size, block_size, len(prompt), reason, detail)


def _checkpointed(pool: BlockPool | None, tiers: TierChain, hashes: Sequence[bytes], found: int) -> int:
    """Of the ``found`` blocks, how many a hit serves: with state layers, up to the last one
    whose checkpoint the pool or a tier holds (recency untouched)."""
    if pool is None or not pool.states.enabled:
        return found
    while found and not (
        hashes[found - 1] in pool.states.checkpoints or tiers.holds(hashes[found - 1], STATE_RECORD_GROUP) is not None
    ):
        found -= 1
    return found


def _chain(
    namespace: str | None, prompt: Sequence[int], block_size: int, count: int, salt: bytes | None
) -> list[bytes]:
    """The hashes of the prompt's first ``count`` full blocks."""
    parent = namespace_root(namespace)
    hashes: list[bytes] = []
    for index in range(count):
        parent = hash_block(parent, prompt[index * block_size : (index + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def _why_missing(
    config: CacheConfig,
    prompt: Sequence[int],
    salt: bytes | None,
    index: int,
    pool: BlockPool | None,
    tiers: TierChain,
) -> tuple[str, str]:
    """Why block ``index`` is found nowhere: the most specific reason of the module docstring."""
    other = _pool_salt(pool, prompt, config.block_size, index, salt)
    if other is not None:
        return "other salt", f"the pool holds blocks 0-{index} under {other}"
    for tier in tiers.tiers:
        hint = _store_hint(tier, config, prompt, salt, index)
        if hint is not None:
            return hint
    return "not cached", f"block {index} was never computed here, or was evicted since"


def _pool_salt(
    pool: BlockPool | None, prompt: Sequence[int], block_size: int, index: int, salt: bytes | None
) -> str | None:
    """How the pool holds the prompt's blocks ``0..index`` under another salt, if it does."""
    prefix = pool.prefix if pool is not None else None
    if prefix is None:
        return None
    tokens = tuple(prompt[index * block_size : (index + 1) * block_size])
    for entry in prefix.entries():
        if entry.token_ids == tokens and entry.salt != salt and _same_chain(entry, prompt, block_size, index):
            return "no salt" if entry.salt is None else f"another salt ({len(entry.salt)} bytes)"
    return None


def _same_chain(entry: PrefixEntry, prompt: Sequence[int], block_size: int, index: int) -> bool:
    """Whether ``entry`` stands for the prompt's block ``index`` (its parents for the blocks before)."""
    node: PrefixEntry | None = entry
    for position in range(index, -1, -1):
        if node is None or node.token_ids != tuple(prompt[position * block_size : (position + 1) * block_size]):
            return False
        node = node.parent
    return node is None


def _store_hint(
    tier: Any, config: CacheConfig, prompt: Sequence[int], salt: bytes | None, index: int
) -> tuple[str, str] | None:
    """What a shared store (a tier with ``survey`` and ``exists``) says about the prompt's
    first block: held without the salt, in records of another block size, or only records
    of other geometries or namespaces. ``None`` when it says nothing (or fails)."""
    survey = getattr(tier, "survey", None)
    exists = getattr(tier, "exists", None)
    if index != 0 or not callable(survey) or not callable(exists):
        return None  # the prompt is partly cached: its tail was not
    try:
        families = cast("dict[str, dict[str, set[str]]]", survey())
        if salt is not None and exists(config, _chain(config.model_id, prompt, config.block_size, 1, None)[0], None):
            return "other salt", f"the store {tier.name!r} holds the prompt's first block without a salt"
        ours = namespace_part(config.model_id)
        tags = families.get(ours, {})
        for block_size in _BLOCK_SIZES:
            if block_size == config.block_size or len(prompt) <= block_size:
                continue
            other = _with_block_size(config, block_size)
            if other is None or record_format_tag(other) not in tags:
                continue
            first = _chain(config.model_id, prompt, block_size, 1, salt)[0]
            if exists(other, first, salt):
                return "block size mismatch", (
                    f"the store {tier.name!r} holds the prompt in blocks of {block_size} tokens; this pool's hold "
                    f"{config.block_size}"
                )
        if tags and record_format_tag(config) not in tags:
            return "other geometry", (
                f"the store {tier.name!r} holds records of this namespace for another geometry or dtype only"
            )
        if families and ours not in families:
            shown = ", ".join(sorted(families)[:5])
            return "other namespace", f"the store {tier.name!r} holds records of other namespaces only ({shown})"
    except Exception:  # a diagnosis, never a failure: the store's answer is simply missing
        return None
    return None


def _with_block_size(config: CacheConfig, block_size: int) -> CacheConfig | None:
    """``config`` with another block size (``None`` where that is no valid configuration)."""
    try:
        return dataclasses.replace(config, block_size=block_size)
    except Exception:
        return None
