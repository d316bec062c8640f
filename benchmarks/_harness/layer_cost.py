"""Where a decode forward of ``PagedCache`` spends its time, measured inside ``generate``.

:class:`LayerCost` times, per decode forward of one ``model.generate`` run, the calls that
enter kvcache from transformers (``PagedCache.update``, the ``"kvcache_paged"`` attention
function and its mask function) and, within them, the attention arithmetic (the compiled
kernel's call, torch's ``scaled_dot_product_attention`` on the pool's views, the storage's
own attention); what remains is the cost per layer besides the arithmetic: the write of the
new K/V, the step's planning, the dispatch, the checks, the Python. Measured in the run
itself, it does not depend on the model around it, whose time moves with the machine's
neighbours far more than these microseconds do (a difference of two whole runs, with and
without the arithmetic, reads negative on a busy host).

The kernel call's own Python (about 10 microseconds with arrays, less by address) counts as
arithmetic; each timed call
adds about a microsecond of its own. :func:`decode_updates` times a cache's ``update`` alone
(the contiguous path's, beside ``DynamicCache``'s). Needs torch and transformers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, cast
from unittest import mock

import transformers

import kvcache_torch.lanes
import kvcache_torch.storage
from kvcache_core.attention.kernel import KernelCall
from kvcache_torch.hf import ATTN_IMPLEMENTATION, PagedCache
from kvcache_torch.hf.attention import paged_attention_forward, paged_attention_mask, register_attention

__all__ = ["LayerCost", "decode_updates", "measure_layer_cost", "timing_arithmetic"]


@dataclass
class _Forward:
    entered: float = 0.0  # seconds inside kvcache's entry points
    arithmetic: float = 0.0  # of which in the attention arithmetic


@dataclass
class LayerCost:
    """Per decode forward, the seconds inside kvcache and in its attention arithmetic."""

    layers: int
    forwards: list[_Forward] = field(default_factory=list[_Forward])
    _mask: float = 0.0  # the mask of the forward about to start
    _depth: int = 0  # arithmetic calls nest (the storage's attention may call the kernel)

    def per_layer(self) -> list[float]:
        """Seconds per layer besides the arithmetic, per decode forward."""
        return [(forward.entered - forward.arithmetic) / self.layers for forward in self.forwards]

    def arithmetic_per_layer(self) -> list[float]:
        return [forward.arithmetic / self.layers for forward in self.forwards]

    def summary(self) -> str:
        """The median and the mean per layer besides the arithmetic, and the arithmetic's median."""
        if not self.forwards:
            return "no decode forward was seen"
        besides = self.per_layer()
        return (
            f"{statistics.median(besides) * 1e6:.0f} us median ({statistics.fmean(besides) * 1e6:.0f} us mean) "
            f"over {len(besides)} decode forwards, besides "
            f"{statistics.median(self.arithmetic_per_layer()) * 1e6:.0f} us of attention arithmetic"
        )

    def start_forward(self) -> None:
        """Begin a forward by hand (outside ``generate``: a benchmark's own calls)."""
        self.forwards.append(_Forward())

    def arithmetic_so_far(self) -> float:
        """Seconds of arithmetic in the current forward (0 before one starts)."""
        return self.forwards[-1].arithmetic if self.forwards else 0.0

    def entry(self, function: Callable[..., Any], decode: Callable[..., bool], first: bool) -> Callable[..., Any]:
        """``function``, an entry point from transformers, timed into the current decode forward
        where ``decode(*args)`` says the call is one (``first``: ``PagedCache.update``, whose call
        for layer 0 starts a forward)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                starts = first and (args[3] if len(args) > 3 else kwargs.get("layer_idx")) == 0  # layer 0's update
                if decode(*args, **kwargs):
                    if starts:  # a decode forward starts
                        self.forwards.append(_Forward(entered=self._mask))
                    if self.forwards:
                        self.forwards[-1].entered += spent
                if starts:
                    self._mask = 0.0

        return timed

    def masked(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """The mask function, timed into the forward that follows it."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._mask += time.perf_counter() - start

        return timed

    def leaf(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """An attention's arithmetic, timed into the current forward's (the outermost of nested calls)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0 and self.forwards:
                    self.forwards[-1].arithmetic += time.perf_counter() - start

        return timed


def _update_decodes(cache: object, keys: Any, *args: Any, **kwargs: Any) -> bool:
    return int(keys.shape[2]) == 1


def _attention_decodes(module: object, query: Any, *args: Any, **kwargs: Any) -> bool:
    return int(query.shape[2]) == 1


@contextmanager
def measure_layer_cost(layers: int) -> Generator[LayerCost]:
    """Within the block, every decode forward of ``PagedCache`` with ``"kvcache_paged"``
    attention is timed into the :class:`LayerCost` yielded (``layers``: the model's)."""
    cost = LayerCost(layers)
    interfaces = (transformers.AttentionInterface, transformers.masking_utils.AttentionMaskInterface)
    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(PagedCache, "update", cost.entry(PagedCache.update, _update_decodes, first=True))
        )
        timed_attention = cost.entry(paged_attention_forward, _attention_decodes, first=False)
        interfaces[0].register(ATTN_IMPLEMENTATION, timed_attention)  # pyright: ignore[reportUnknownMemberType]
        interfaces[1].register(ATTN_IMPLEMENTATION, cost.masked(paged_attention_mask))  # pyright: ignore[reportUnknownMemberType]
        stack.callback(register_attention)  # the untimed functions again
        stack.enter_context(timing_arithmetic(cost))
        yield cost


@contextmanager
def timing_arithmetic(cost: LayerCost) -> Generator[None]:
    """Within the block, the torch backend's attention arithmetic (the kernel's call, with
    arrays or by address, torch's SDPA on the pool's views, the storage's own attention) is
    timed into ``cost``'s current forward."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(KernelCall, "__call__", cost.leaf(KernelCall.__call__)))
        stack.enter_context(mock.patch.object(KernelCall, "attend_at", cost.leaf(KernelCall.attend_at)))
        stack.enter_context(mock.patch.object(kvcache_torch.lanes, "_SDPA", cost.leaf(kvcache_torch.lanes._SDPA)))  # pyright: ignore[reportPrivateUsage]
        for module in (kvcache_torch.lanes, kvcache_torch.storage):
            stack.enter_context(mock.patch.object(module, "attend_pool", cost.leaf(module.attend_pool)))
        yield


@contextmanager
def decode_updates(owner: type[PagedCache] | type[transformers.DynamicCache]) -> Generator[list[float]]:
    """Within the block, every decode call (one new token per row) of ``owner.update`` (a
    cache's: ``PagedCache`` on the contiguous path, ``DynamicCache``) is timed, in seconds, into
    the list yielded: what a layer of a decode step spends handing the model its K/V."""
    times: list[float] = []
    original = cast("Callable[..., Any]", owner.update)  # pyright: ignore[reportUnknownMemberType]  # transformers: partly untyped

    def timed(cache: object, keys: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(cache, keys, *args, **kwargs)
        finally:
            if _update_decodes(cache, keys):
                times.append(time.perf_counter() - start)

    with mock.patch.object(owner, "update", timed):
        yield times
