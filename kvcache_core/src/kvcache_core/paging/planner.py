"""The prefix-hit planner: where each block of a new request's prompt comes from.

A prompt's full blocks are walked once, each hashed once (the last prompt token is always
left to compute). Block by block and KV-cache group by group (:mod:`kvcache_core.contract.groups`)
the plan says whether the block is mapped from the pool (a prefix hit), written from an
offload tier (the record of that hash and group) or taken new;
:meth:`~kvcache_core.paging.sequences.SequenceBlocks.open` carries the plan out once.

The hit rule: ``n`` logical blocks serve a prompt only if every full group has a block of
each, every sliding group of those its window sees from the first uncached token, and some
group holds each (so the hash chain goes on); ``n`` shrinks until that holds. The pool is
planned first (:meth:`PrefixPlanner.plan`: its hit is the longest prefix every group of the
pool serves, and whether the request fits is decided on it alone); the tiers then continue
it (:meth:`PrefixPlanner.extend`), a group's block being its record in a tier or its block
of that hash still in the pool, as far as the pool has the blocks to take for them. With
state layers the tiers continue it only to a block whose state checkpoint the pool or a
tier holds (a tier's checkpoint is the record of that hash in the reserved group
:data:`~kvcache_core.contract.states.STATE_RECORD_GROUP`): a hit never goes past the last
checkpoint it can start from.

Tiers are consulted through :class:`TierLookup` (paging knows no tier): it says which tier
holds a group's record of a hash and gives records back checked, a failing tier or a bad
record being a miss there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy.typing as npt

from kvcache_core.contract.config import AllocationRequest
from kvcache_core.contract.groups import first_visible_block
from kvcache_core.contract.states import STATE_RECORD_GROUP
from kvcache_core.paging import prefix as hashing
from kvcache_core.paging.block_pool import BlockPool, blocks_for
from kvcache_core.paging.prefix import PrefixEntry

__all__ = ["AllocationPlan", "Opened", "PrefixPlanner", "Promotion", "TierBlock", "TierHit", "TierLookup", "filled"]


class TierBlock(Protocol):
    """One group's block of one hash as a tier gives it back: its host K/V and the tokens
    and salt it stands for."""

    @property
    def keys(self) -> npt.NDArray[Any]: ...

    @property
    def values(self) -> npt.NDArray[Any]: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def salt(self) -> bytes | None: ...


class TierLookup(Protocol):
    """The offload tiers as the planner sees them (implemented by the manager's tier stack)."""

    def __bool__(self) -> bool:
        """Whether there is any tier."""
        ...

    def holds(self, block_hash: bytes, group: int) -> int | None:
        """The level of the first tier holding ``group``'s record of ``block_hash``, or
        ``None`` (also when a tier cannot say: counted, with a warning)."""
        ...

    def fetch(self, block_hash: bytes, group: int, parent: bytes | None) -> tuple[int, TierBlock] | None:
        """The first tier holding ``group``'s record of ``block_hash`` (its level) and the
        record, checked (filed under its key, of a block's shape and host dtype, hashed from
        ``parent``, its checksum intact); ``None`` where no tier gives it back intact (a
        record that fails is dropped from its tier, counted, with a warning)."""
        ...

    def take_out(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """The records ``(block hash, group)`` went into the pool: they leave the tiers."""
        ...

    @property
    def looks_ahead(self) -> bool:
        """Whether a tier wants the prompt's hashes before it is asked about them (:meth:`prefetch`)."""
        ...

    def prefetch(self, block_hashes: Sequence[bytes], salt: bytes | None) -> None:
        """The hashes the planner may ask about next, in the prompt's order, and the salt
        hashed into them: a remote tier looks them all up at once (a failing one is a miss
        there: counted, with a warning)."""
        ...


class TierHit(NamedTuple):
    """One record a promotion writes into a new pool block."""

    group: int
    offset: int  # its logical block, counted from the pool's hits
    level: int  # the tier it comes from
    block_hash: bytes
    record: TierBlock


class Promotion(NamedTuple):
    """The blocks after the pool's hits that the tiers continue the prefix with."""

    length: int  # logical blocks
    pooled: list[list[int | None]]  # per group, per block: the pool block mapped, None where it is new
    records: list[TierHit]  # group by group, in logical order
    checkpoint_hash: bytes | None = None  # with state layers: the last promoted block's, its checkpoint's
    checkpoint: TierHit | None = None  # that checkpoint's record, when a tier (not the pool) holds it


class AllocationPlan(NamedTuple):
    """What ``allocate`` would do, worked out without changing anything."""

    entries: list[PrefixEntry]  # per cached logical block mapped: its prefix-cache entry
    mapped: list[list[int]]  # per KV-cache group: the cached blocks to map (after ``released``)
    released: list[int]  # per group: leading hit blocks a sliding window leaves unmapped
    queries: int  # full prompt blocks looked up
    collisions: int
    new_blocks: int  # blocks to take from the pool, every group together (without a promotion)
    revived: int  # mapped hit blocks that are cached now (not free, not in use)
    logical_total: int = 0  # logical blocks the request holds without a promotion
    found: tuple[PrefixEntry, ...] = ()  # the pool's entries of the prompt's first blocks, before shortening
    hashes: tuple[bytes, ...] = ()  # the hashes of the blocks walked (``found``'s, then the first miss's)
    promotion: Promotion | None = None  # the tiers' continuation (:meth:`PrefixPlanner.extend`)

    @property
    def hits(self) -> int:
        """Logical blocks served from the pool's prefix cache."""
        return len(self.entries)


class Opened(NamedTuple):
    """What opening a request served: its cached logical blocks (pool and tiers) and the
    tier level of each record promoted."""

    hits: int
    tier_hits: tuple[int, ...]


class PrefixPlanner:
    """Plans a new request's prefix hit over one :class:`BlockPool` and, given, its tiers
    (manager internals, under its lock)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.config.block_size
        self.windows = [group.window for group in pool.config.kv_groups]

    def first_held(self, group: int, end: int) -> int:
        """The first logical block ``group`` holds once ``end`` blocks are cached: 0 for a
        full group, the first its window sees from the first uncached token for a sliding
        one."""
        return min(end, first_visible_block(self.windows[group], end * self.block_size, self.block_size))

    # -- the pool ------------------------------------------------------------------------

    def plan(self, request: AllocationRequest) -> AllocationPlan:
        """The prompt's hit in the pool and the blocks ``allocate`` needs (no tier is asked)."""
        found, hashes, queries, collisions = self._walk(request)
        hits, mapped, released = self._servable(found)
        logical_total = max(hits, blocks_for(request.initial_tokens, self.block_size))
        is_cached = self.pool.allocator.is_cached
        revived = sum(1 for blocks in mapped for block in blocks if is_cached(block))
        new_blocks = (logical_total - hits) * len(self.windows)
        return AllocationPlan(
            list(found[:hits]),
            mapped,
            released,
            queries,
            collisions,
            new_blocks,
            revived,
            logical_total,
            tuple(found),
            tuple(hashes),
        )

    def _walk(self, request: AllocationRequest) -> tuple[list[PrefixEntry], list[bytes], int, int]:
        """The pool's entries of the prompt's full blocks, in order, up to the first it
        lacks; the hashes computed (theirs, then the first miss's); the blocks to look up;
        the hash collisions met."""
        prefix = self.pool.prefix
        prompt = request.prompt_token_ids
        found: list[PrefixEntry] = []
        hashes: list[bytes] = []
        if prefix is None or not prompt:
            return found, hashes, 0, 0
        block_size = self.block_size
        queries = (len(prompt) - 1) // block_size
        collisions = 0
        salt = request.salt_bytes()
        parent: PrefixEntry | None = None
        for logical in range(queries):
            tokens = prompt[logical * block_size : (logical + 1) * block_size]
            block_hash = hashing.hash_block(prefix.parent_hash(parent), tokens, salt)
            hashes.append(block_hash)
            entry = prefix.get(block_hash)
            if entry is None:
                break
            if not entry.matches(parent, tokens, salt):
                collisions += 1  # other tokens under this hash
                break
            found.append(entry)
            parent = entry
        return found, hashes, queries, collisions

    def _servable(self, entries: list[PrefixEntry]) -> tuple[int, list[list[int]], list[int]]:
        """The longest cached prefix every group can serve from the pool: ``(hits, mapped,
        released)``.

        A full group needs a block of its own for every hit; a sliding group only for the
        hits its window still sees from the first uncached token (``released`` of them
        are left unmapped). Where a group lacks one, the hit is shortened until every
        group is served: a prefix is mapped in every group or in none.
        """
        pool = self.pool
        picks = [[pool.pick_block(entry, group) for entry in entries] for group in range(len(self.windows))]
        hits = len(entries)
        for group, window in enumerate(self.windows):
            if window is None:
                hits = min(hits, next((i for i, block in enumerate(picks[group]) if block is None), hits))
        hashes = [entry.block_hash for entry in entries] if pool.states.enabled else []
        hits = pool.states.checkpointed(hashes, hits)  # state layers restart from a checkpoint
        while True:
            released = [self.first_held(group, hits) for group in range(len(picks))]
            if all(None not in picks[group][released[group] : hits] for group in range(len(picks))):
                break
            hits = pool.states.checkpointed(hashes, hits - 1)
        mapped = [
            [block for block in picks[group][released[group] : hits] if block is not None]
            for group in range(len(picks))
        ]
        return hits, mapped, released

    # -- the tiers -----------------------------------------------------------------------

    def extend(self, plan: AllocationPlan, request: AllocationRequest, tiers: TierLookup) -> AllocationPlan:
        """``plan`` continued by the tiers: the blocks after the pool's hits that some tier
        (or, in a group, the pool) holds, as far as the hit rule allows, every record
        fetched and checked, and the pool has the blocks to take for them once ``plan``'s
        own are taken. A record a tier cannot give back intact, or of other tokens or
        salt, shortens the run."""
        prefix = self.pool.prefix
        prompt = request.prompt_token_ids
        if not tiers or prefix is None or not prompt:
            return plan
        block_size = self.block_size
        salt = request.salt_bytes()
        groups = range(len(self.windows))
        start = plan.hits
        parent_hash = plan.entries[-1].block_hash if start else prefix.parent_hash(None)
        hashes: list[bytes] = []
        pooled: list[list[int | None]] = [[] for _ in groups]
        have: list[list[bool]] = [[] for _ in groups]
        spare = self.pool.available() - plan.new_blocks - plan.revived
        ahead: list[bytes] = []  # the hashes a tier looking ahead is told, as far as the pool could take them
        if tiers.looks_ahead and spare > 0:
            for logical in range(start, min(plan.queries, start + spare)):
                tokens = prompt[logical * block_size : (logical + 1) * block_size]
                known = logical < len(plan.hashes)
                ahead.append(plan.hashes[logical] if known else hashing.hash_block(parent_hash, tokens, salt))
                parent_hash = ahead[-1]
            parent_hash = plan.entries[-1].block_hash if start else prefix.parent_hash(None)
            tiers.prefetch(ahead, salt)
        for logical in range(start, plan.queries):
            tokens = prompt[logical * block_size : (logical + 1) * block_size]
            # Each block is hashed once: the pool's walk hashed its hits and its first miss.
            if logical < len(plan.hashes):
                block_hash = plan.hashes[logical]
            elif logical - start < len(ahead):
                block_hash = ahead[logical - start]
            else:
                block_hash = hashing.hash_block(parent_hash, tokens, salt)
            entry = plan.found[logical] if logical < len(plan.found) else prefix.get(block_hash)
            if entry is not None and (
                entry.token_ids != tokens or entry.salt != salt or prefix.parent_hash(entry.parent) != parent_hash
            ):
                entry = None  # a collision: other tokens under this hash
            picks = [None if entry is None else self.pool.pick_block(entry, group) for group in groups]
            levels = [tiers.holds(block_hash, group) if picks[group] is None else None for group in groups]
            if entry is None and all(level is None for level in levels):
                break
            hashes.append(block_hash)
            for group in groups:
                pooled[group].append(picks[group])
                have[group].append(picks[group] is not None or levels[group] is not None)
            parent_hash = block_hash
        parents: list[bytes | None] = [plan.entries[-1].block_hash if start else None, *hashes[:-1]]
        fetched: dict[tuple[int, int], tuple[int, TierBlock]] = {}  # (group, index) -> (tier level, record)
        states = self.pool.states
        # With state layers a promotion ends at a block whose checkpoint the pool or a tier holds.
        checkpointed = (
            [
                block_hash in states.checkpoints or tiers.holds(block_hash, STATE_RECORD_GROUP) is not None
                for block_hash in hashes
            ]
            if states.enabled
            else None
        )
        checkpoint: TierHit | None = None
        while True:
            count = self._promotable(plan, have, pooled, spare, checkpointed)
            if not count:
                return plan
            missing = False
            last = count - 1
            if checkpointed is not None and hashes[last] not in states.checkpoints:
                hit = fetched.get((STATE_RECORD_GROUP, last)) or tiers.fetch(
                    hashes[last], STATE_RECORD_GROUP, parents[last]
                )
                tokens = prompt[(start + last) * block_size : (start + last + 1) * block_size]
                if hit is None or hit[1].token_ids != tokens or hit[1].salt != salt:
                    checkpointed[last] = False  # unreadable, or another prefix's: shorten
                    continue
                fetched[(STATE_RECORD_GROUP, last)] = hit
                checkpoint = TierHit(STATE_RECORD_GROUP, last, hit[0], hashes[last], hit[1])
            else:
                checkpoint = None
            for group, index in self._needed(start, count):
                if pooled[group][index] is not None or (group, index) in fetched:
                    continue
                hit = tiers.fetch(hashes[index], group, parents[index])
                tokens = prompt[(start + index) * block_size : (start + index + 1) * block_size]
                if hit is None or hit[1].token_ids != tokens or hit[1].salt != salt:
                    have[group][index] = False  # unreadable, or another prefix's: shorten
                    missing = True
                else:
                    fetched[(group, index)] = hit
            if not missing:
                break
        records: list[TierHit] = []
        for group, index in self._needed(start, count):
            if pooled[group][index] is None:
                level, record = fetched[(group, index)]
                records.append(TierHit(group, index, level, hashes[index], record))
        last_hash = hashes[count - 1] if checkpointed is not None else None
        return plan._replace(
            promotion=Promotion(count, [row[:count] for row in pooled], records, last_hash, checkpoint)
        )

    def _needed(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(group, index)`` of every block that promoting ``count`` blocks from logical
        ``start`` maps, group by group in logical order (``index`` counts from ``start``)."""
        return [
            (group, index)
            for group in range(len(self.windows))
            for index in range(max(0, self.first_held(group, start + count) - start), count)
        ]

    def _promotable(
        self,
        plan: AllocationPlan,
        have: list[list[bool]],
        pooled: list[list[int | None]],
        spare: int,
        checkpointed: list[bool] | None,
    ) -> int:
        """The most blocks after the pool's hits that every group can be served: a full
        group has a block or record of every one, a sliding group of those its window
        sees, some group holds each, the pool has the blocks to take for them beyond
        the ``spare`` left once the plan's own are taken, and (``checkpointed`` given: a
        pool with state layers) the last one's state checkpoint is held."""
        start = plan.hits
        count = len(have[0]) if have else 0
        for group, window in enumerate(self.windows):
            if window is None:
                count = min(count, next((index for index, known in enumerate(have[group]) if not known), count))
        is_cached = self.pool.allocator.is_cached
        reserved = plan.logical_total - start  # new blocks every group takes for the plan itself
        while count:
            if checkpointed is not None and not checkpointed[count - 1]:
                count -= 1
                continue
            firsts = [self.first_held(group, start + count) for group in range(len(self.windows))]
            if min(firsts) <= start and all(have[group][index] for group, index in self._needed(start, count)):
                rows = [
                    [
                        pooled[group][logical - start] if logical < start + count else None
                        for logical in range(max(start, first), max(start + count, plan.logical_total))
                    ]
                    for group, first in enumerate(firsts)
                ]
                extra = sum(max(0, row.count(None) - reserved) for row in rows)
                revived = sum(1 for row in rows for block in row if block is not None and is_cached(block))
                if extra + revived <= spare:
                    return count
            count -= 1
        return 0

    # -- carrying a plan out -------------------------------------------------------------

    def layout(self, plan: AllocationPlan, promoted: bool) -> tuple[int, list[int], list[list[int | None]]]:
        """What the request's tables hold once ``plan`` is carried out (with its promotion
        or without): ``(hits, firsts, rows)``, ``rows[g]`` the blocks of group ``g`` from
        its first held logical block ``firsts[g]`` on, the pool block mapped there or
        ``None`` for a new one (written from a tier, or taken past the hits)."""
        promotion = plan.promotion if promoted else None
        start = plan.hits
        hits = start + (promotion.length if promotion is not None else 0)
        end = max(hits, plan.logical_total)
        firsts = [self.first_held(group, hits) for group in range(len(self.windows))]
        rows: list[list[int | None]] = []
        for group, first in enumerate(firsts):
            row: list[int | None] = []
            for logical in range(first, end):
                if logical < start:
                    row.append(plan.mapped[group][logical - plan.released[group]])
                elif promotion is not None and logical < hits:
                    row.append(promotion.pooled[group][logical - start])
                else:
                    row.append(None)
            rows.append(row)
        return hits, firsts, rows


def filled(rows: list[list[int | None]], taken: list[list[int]]) -> list[list[int]]:
    """``rows`` (:meth:`PrefixPlanner.layout`) with each ``None`` replaced by the next of
    its group's new blocks ``taken``, in order."""
    blocks: list[list[int]] = []
    for row, new in zip(rows, taken, strict=True):
        supply = iter(new)
        blocks.append([next(supply) if block is None else block for block in row])
    return blocks
