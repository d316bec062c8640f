"""The state pool's slots: one per live resident request of a pool with state layers, and
checkpoints.

:class:`StateSlots` owns the backend's :class:`~kvcache_core.contract.states.StateStorage`
and the free list of its slots. Taking a slot fills it first (zeros for a new request, the
parent's states for a fork, host copies for a swap-in, a checkpoint for a prefix hit) and
marks it taken only once the storage call returned, so a storage that raises leaves every
slot as it was.

With prefix caching, a free slot may hold a **checkpoint**: a copy of a request's states
after a whole number of blocks, filed under the hash of its last block
(``step.checkpoint_states()``). A prompt's prefix hit is cut back to its last block with a
checkpoint (the new request starts from that copy), and ``truncate`` may go back to one.
Checkpoints are evicted least recently used first when a request needs a slot (to an
offload tier, when the manager has one: :attr:`StateSlots.on_evict`).

A take gets the lowest free slot, whatever order slots came back in: requests allocated one
after another then hold ascending slots, so a step over them reads its states as one run of
the pool's rows, in place (``Step.state_view``), also after earlier requests were released.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvcache_core.contract.config import CacheConfig
from kvcache_core.contract.states import STATE_LAYERS, StateStorage
from kvcache_core.errors import (
    InvalidArgumentError,
    InvariantError,
    LayerIndexError,
    OutOfStateSlotsError,
    UnsupportedConfigError,
)

if TYPE_CHECKING:
    from kvcache_core.paging.request_state import RequestState

__all__ = ["StateSlots", "check_state_slots", "slot_run"]


def _one(slot: int) -> npt.NDArray[np.int64]:
    return np.array([slot], dtype=np.int64)


class StateSlots:
    """The slots of a pool's state arrays (manager internals, under its lock).

    Attributes:
        storage: the backend's state pool, ``None`` without state layers.
        num_slots: slots in the pool (0 without state layers).
        failures: operations refused for want of a free slot.
    """

    def __init__(self, config: CacheConfig, storage: object, backend: str = "custom") -> None:
        self.config = config
        self.num_slots = config.states.num_slots
        self.storage: StateStorage[Any] | None = None
        self._index = {(layer, array.name): index for index, (layer, array) in enumerate(config.states.arrays)}
        self._free = list(range(self.num_slots - 1, -1, -1))  # descending: pop() takes the lowest
        self.taken: set[int] = set()
        self.checkpoints: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest first
        self.failures = 0
        self.on_filed: Callable[[bytes], object] | None = None  # told the hash of each checkpoint filed
        # Given (hash, slot) of a checkpoint evicted for a take, before its slot is reused.
        self.on_evict: Callable[[bytes, int], object] | None = None
        if not config.states.arrays:
            return
        factory = getattr(storage, "state_storage", None)
        if not callable(factory):
            raise UnsupportedConfigError(
                f"the {backend!r} storage ({type(storage).__name__}) does not serve {STATE_LAYERS!r}: its config has "
                f"{len({layer for layer, _ in config.states.arrays})} recurrent-state layers and the storage has no "
                "state_storage(arrays, num_slots); use a backend that claims the capability (numpy, torch, jax)"
            )
        arrays = tuple(array for _, array in config.states.arrays)
        self.storage = cast("StateStorage[Any]", factory(arrays, self.num_slots))

    @property
    def enabled(self) -> bool:
        """Whether the pool has state layers."""
        return self.storage is not None

    def available(self) -> int:
        """Free slots, those holding checkpoints included (evictable)."""
        return len(self._free) + len(self.checkpoints)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the whole state pool."""
        return self.num_slots * self.config.states.bytes_per_slot

    def shortage(self, what: str) -> OutOfStateSlotsError:
        """Count a refusal; the error of an operation that needs a slot when none is free."""
        self.failures += 1
        return OutOfStateSlotsError(
            f"{what}: every one of the {self.num_slots} state slots is taken (one per live request of a pool "
            "with recurrent-state layers; CacheConfig.state_slots sets how many)"
        )

    def take(self, what: str, keep: tuple[int, ...] = ()) -> int:
        """A free slot, zero-filled (a new request's states start from zeros); the
        checkpoints of the slots ``keep`` are not evicted for it.

        Raises:
            OutOfStateSlotsError: none is free.
        """
        slot = self._peek(what, keep)
        assert self.storage is not None
        self.storage.zero(_one(slot))
        return self._mark(slot)

    def take_copy(self, source: int, what: str, keep: tuple[int, ...] = ()) -> int:
        """A free slot holding a copy of ``source``'s states (fork, a checkpoint's hit);
        neither ``source``'s checkpoint nor those of ``keep`` are evicted for it.

        Raises:
            OutOfStateSlotsError: none is free.
        """
        slot = self._peek(what, (source, *keep))
        assert self.storage is not None
        self.storage.copy(_one(source), _one(slot))
        return self._mark(slot)

    def take_from_host(self, arrays: Sequence[npt.NDArray[Any]], what: str, keep: tuple[int, ...] = ()) -> int:
        """A free slot holding ``arrays`` (a swapped-out request's host copies, a tier's
        checkpoint); the checkpoints of the slots ``keep`` are not evicted for it.

        Raises:
            OutOfStateSlotsError: none is free.
        """
        slot = self._peek(what, keep)
        assert self.storage is not None
        self.storage.from_host(_one(slot), arrays)
        return self._mark(slot)

    def refill(self, slot: int, source: int | None) -> None:
        """Overwrite taken ``slot`` with ``source``'s states (``None``: zeros)."""
        assert self.storage is not None
        if source is None:
            self.storage.zero(_one(slot))
        else:
            self.storage.copy(_one(source), _one(slot))

    def to_host(self, slot: int) -> tuple[npt.NDArray[Any], ...]:
        """Host copies of a slot's states, ``[1, *shape]`` per array."""
        assert self.storage is not None
        return tuple(self.storage.to_host(_one(slot)))

    def give(self, slot: int) -> None:
        """Give a taken slot back (``-1``: none, ignored)."""
        if slot >= 0:
            self.taken.remove(slot)
            self._free_slot(slot)

    def index(self, layer: object, name: object) -> int:
        """The state pool's array of ``layer``'s state array ``name``.

        Raises:
            LayerIndexError: ``layer`` out of range or not a state layer.
            InvalidArgumentError: the layer has no array ``name`` (the message lists them).
        """
        index = self.config.check_layer(layer)
        state = self.config.layer_spec(index).state
        if state is None:
            held = "K/V" if self.config.layer_spec(index).keeps_kv else "nothing"
            raise LayerIndexError(
                f"layer {index} keeps {held}, not a recurrent state: state layers are "
                f"{sorted({layer for layer, _ in self.config.states.arrays})}"
            )
        found = self._index.get((index, name)) if isinstance(name, str) else None
        if found is None:
            raise InvalidArgumentError(
                f"layer {index} has no state array {name!r}; its arrays: {', '.join(state.names())}"
            )
        return found

    def _peek(self, what: str, keep: tuple[int, ...] = ()) -> int:
        """The slot the next take fills: a free one, else the oldest checkpoint's but those of ``keep``."""
        if not self._free:
            victim = next((key for key, slot in self.checkpoints.items() if slot not in keep), None)
            if victim is None:
                raise self.shortage(what)
            if self.on_evict is not None:  # an offload tier keeps it
                self.on_evict(victim, self.checkpoints[victim])
            self._free_slot(self.checkpoints.pop(victim))
        return self._free[-1]

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint_of(self, block_hash: bytes) -> int | None:
        """The slot of the checkpoint filed under ``block_hash`` (now the most recently used)."""
        slot = self.checkpoints.get(block_hash)
        if slot is not None:
            self.checkpoints.move_to_end(block_hash)
        return slot

    def checkpointed(self, hashes: Sequence[bytes], hits: int) -> int:
        """The longest of the first ``hits`` blocks (of ``hashes``) whose last has a
        checkpoint: a pool with state layers serves a prefix only up to one (0 without)."""
        if not self.enabled:
            return hits
        while hits and hashes[hits - 1] not in self.checkpoints:
            hits -= 1
        return hits

    def save_checkpoint(self, slot: int, block_hash: bytes) -> bool:
        """File a copy of ``slot``'s states under ``block_hash``, in a free slot or the
        oldest checkpoint's; none when every slot is held by a request. Returns whether
        one is filed (an existing one of that hash is kept: the same tokens, the same states)."""
        if block_hash in self.checkpoints:
            self.checkpoints.move_to_end(block_hash)
            return True
        if not self._free and not self.checkpoints:
            return False
        target = self._peek("", (slot,))
        assert self.storage is not None
        self.storage.copy(_one(slot), _one(target))
        self._free.pop()
        self.checkpoints[block_hash] = target
        if self.on_filed is not None:
            self.on_filed(block_hash)
        return True

    def stage(self, hosts: Sequence[Sequence[npt.NDArray[Any]]]) -> list[int]:
        """Write the host states of checkpoints (one slot's each) into free slots, as many
        as are free (no checkpoint is evicted for them), in one storage call; the slots
        stay free until :meth:`file_staged` files them. Returns the slots, in order.

        Raises:
            Exception: what the storage raises (nothing has changed).
        """
        slots = self._free[::-1][: len(hosts)]
        if slots and self.storage is not None:
            arrays = [np.concatenate([host[index] for host in hosts[: len(slots)]]) for index in range(len(hosts[0]))]
            self.storage.from_host(np.asarray(slots, dtype=np.int64), arrays)
        return slots

    def file_staged(self, slot: int, block_hash: bytes) -> bool:
        """File the staged ``slot`` (:meth:`stage`) as the checkpoint of ``block_hash``,
        unless one of that hash is filed already; whether it was."""
        if block_hash in self.checkpoints or slot not in self._free:
            return False
        self._free.remove(slot)
        self.checkpoints[block_hash] = slot
        if self.on_filed is not None:
            self.on_filed(block_hash)
        return True

    def announce(self, block_hash: bytes) -> None:
        """Tell :attr:`on_filed` that a checkpoint of ``block_hash`` is held (in the pool or
        an offload tier) although none was filed now (a promotion ending at one)."""
        if self.on_filed is not None:
            self.on_filed(block_hash)

    def drop_checkpoint(self, block_hash: bytes) -> None:
        """Forget the checkpoint filed under ``block_hash`` (it went to an offload tier with
        its block); its slot is free."""
        slot = self.checkpoints.pop(block_hash, None)
        if slot is not None:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        """Put ``slot`` among the free ones, keeping them descending (the lowest is taken next)."""
        bisect.insort(self._free, slot, key=lambda free: -free)

    def _mark(self, slot: int) -> int:
        popped = self._free.pop()
        assert popped == slot
        self.taken.add(slot)
        return slot


def slot_run(slots: npt.NDArray[np.int64]) -> tuple[int, int] | None:
    """``(first, count)`` when ``slots`` are one ascending run of state slots, else ``None``."""
    count = int(slots.shape[0])
    first = int(slots[0]) if count else 0
    if count == 0 or not np.array_equal(slots, np.arange(first, first + count)):
        return None
    return first, count


def check_state_slots(states: StateSlots, requests: Mapping[str, RequestState[Any]]) -> None:
    """Each resident request of a pool with state layers holds a slot of its own, each
    swapped-out one host copies and no slot, and the taken slots are exactly theirs.

    Raises:
        InvariantError: naming the first inconsistency found.
    """
    held: dict[int, str] = {}
    for state in requests.values():
        swapped = state.swap is not None
        if not states.enabled:
            if state.state_slot != -1 or state.state_host is not None:
                raise InvariantError(f"request {state.request_id!r} holds a state slot in a pool without state layers")
            continue
        if swapped != (state.state_slot == -1) or swapped != (state.state_host is not None):
            raise InvariantError(
                f"request {state.request_id!r} (swapped out: {swapped}) holds state slot {state.state_slot} and "
                f"{'host copies' if state.state_host is not None else 'no host copies'}"
            )
        if not swapped:
            if state.state_slot in held:
                raise InvariantError(
                    f"state slot {state.state_slot} is held by {held[state.state_slot]!r} and {state.request_id!r}"
                )
            held[state.state_slot] = state.request_id
    checkpoints = set(states.checkpoints.values())
    if (
        set(held) != states.taken
        or len(states.taken) + states.available() != states.num_slots
        or len(checkpoints) != len(states.checkpoints)
        or checkpoints & states.taken
    ):
        raise InvariantError(
            f"state slots taken {sorted(states.taken)} are not those the resident requests hold {sorted(held)}, "
            f"a checkpoint's slot {sorted(checkpoints)} is taken or filed twice, or taken + free + checkpoints "
            f"!= {states.num_slots}"
        )
