"""The torch backend's attention dispatch: the compiled kernel or torch's own path, by shape class.

On a CPU pool of float32, float16 or bfloat16 the torch backend has two ways to the same
attention (:mod:`kvcache_torch.attention`): the compiled kernel (numba, one call per layer
for the whole batch) and the *native* path, ``scaled_dot_product_attention`` on zero-copy
views of each request's runs of blocks. Which is faster is measured on this machine, per
shape class, by :mod:`kvcache_core.backends.dispatch` (the policy, the calibration file,
the pins); this module only names the classes of torch's calls and keeps the backend's one
:class:`~kvcache_core.backends.dispatch.AttentionDispatch`.
"""

from __future__ import annotations

import weakref
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import torch

import kvcache_core
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.backends.dispatch import AttentionDispatch, ShapeClass, pinned_path
from kvcache_core.contract.page_table import PageTable
from kvcache_core.errors import UnsupportedConfigError
from kvcache_torch.threads import torch_team

__all__ = [
    "DISPATCH",
    "KERNEL_DTYPES",
    "call_kind",
    "chosen_path",
    "host_view",
    "kernel_attention",
    "kernel_reads",
    "measured_plain_path",
    "plain_path",
    "pool_path",
    "remember_path",
    "run_kernel",
    "shape_class",
]


def _numba_version() -> str:
    """numba's version, without importing it (importing numba takes a while)."""
    try:
        return version("numba")
    except PackageNotFoundError:  # the kernel is then unavailable and nothing is dispatched
        return "missing"


#: The torch backend's choices on this machine, shared by its pools.
DISPATCH: Final = AttentionDispatch(
    "torch",
    {
        "kvcache-core": kvcache_core.__version__,
        "kernel": paged_kernel.kernel_sources_stamp(),  # a source checkout's kernel changes within a version
        "torch": str(torch.__version__),
        "numba": _numba_version(),
    },
)

#: What the class of a page table's batch takes from the table and its query offsets, per
#: table (the layers of a step share one table: the work is done once per step).
_BATCHES: weakref.WeakKeyDictionary[PageTable, tuple[object, tuple[list[int], list[int], bool]]] = (
    weakref.WeakKeyDictionary()
)


def _same_offsets(known: object, offsets: npt.NDArray[np.int32]) -> bool:
    """Whether ``known`` are these query offsets (the same array, as a step's layers pass, or equal ones)."""
    if known is offsets:
        return True
    return isinstance(known, np.ndarray) and np.array_equal(cast("npt.NDArray[np.int32]", known), offsets)


def _batch(page_table: PageTable, qo_indptr: npt.NDArray[np.int32]) -> tuple[list[int], list[int], bool]:
    known = _BATCHES.get(page_table)
    if known is not None and _same_offsets(known[0], qo_indptr):
        return known[1]
    offsets = qo_indptr.tolist()
    counts = [int(offsets[b + 1] - offsets[b]) for b in range(page_table.batch_size)]
    lengths = [int(length) for length in page_table.seq_lens.tolist()]
    batch = (counts, lengths, not page_table.one_run_each)
    _BATCHES[page_table] = (qo_indptr, batch)
    return batch


#: The path each kind of call of a step runs, once measured or read (per page table: the
#: layers of a step share it, so a layer after the first looks its path up here and skips
#: the shape class, the pool check and the choice).
_CHOSEN: weakref.WeakKeyDictionary[PageTable, tuple[object, dict[tuple[object, ...], str]]] = (
    weakref.WeakKeyDictionary()
)


def chosen_path(page_table: PageTable, qo_indptr: npt.NDArray[np.int32], call: tuple[object, ...]) -> str | None:
    """The path an earlier call of this step with the same ``call`` signature ran (pools'
    shapes and dtype, query heads, causal, features, threads), or ``None``."""
    known = _CHOSEN.get(page_table)
    if known is None or not _same_offsets(known[0], qo_indptr):
        return None
    return known[1].get(call)


def remember_path(page_table: PageTable, qo_indptr: npt.NDArray[np.int32], call: tuple[object, ...], path: str) -> None:
    """Record the path of a call of this step (see :func:`chosen_path`)."""
    known = _CHOSEN.get(page_table)
    if known is None or not _same_offsets(known[0], qo_indptr):
        paths: dict[tuple[object, ...], str] = {}
        known = (qo_indptr, paths)
        _CHOSEN[page_table] = known
    known[1][call] = path


def call_kind(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, causal: bool, features: tuple[bool, ...]
) -> tuple[object, ...]:
    """What the dispatch's choice for a step depends on besides the step's batch."""
    return (key_cache.shape, value_cache.shape, key_cache.dtype, query.shape[1], causal, features)


def plain_path(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    causal: bool,
    path: str,
) -> str | None:
    """The path :func:`~kvcache_torch.attention.attend_pool` took for a call without attention features of this step
    (after one such call): ``"kernel"`` or ``"native"``; ``None`` when none is known."""
    if path != "auto":
        return path
    return chosen_path(page_table, qo_indptr, call_kind(query, key_cache, value_cache, causal, _PLAIN))


#: The features of a plain call: no window, softcap, sinks or chunk.
_PLAIN: tuple[bool, ...] = (False, False, False, False)


def measured_plain_path(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    kv_layout: str,
    path: str,
) -> str | None:
    """The path :func:`~kvcache_torch.attention.attend_pool` takes for a causal call of this
    step without attention features, found without attending: ``path`` where it is pinned,
    the step's remembered path, or the measured choice of the call's shape class (then
    remembered for the step); ``None`` where the class was never measured on this machine (a
    call of ``attend_pool`` measures it) or the page table has a sliding window."""
    if page_table.sliding_window is not None:
        return None
    if path != "auto" or not query.shape[0]:
        return path if query.shape[0] else "native"
    call = call_kind(query, key_cache, value_cache, True, _PLAIN)
    known = chosen_path(page_table, qo_indptr, call)
    if known is not None:
        return known
    chosen = "native"
    if kernel_reads(key_cache, value_cache):
        choice = DISPATCH.choice(shape_class(query, key_cache, value_cache, page_table, qo_indptr, kv_layout, True, ""))
        if choice is None or choice.path not in ("kernel", "native"):
            return None
        chosen = choice.path
    remember_path(page_table, qo_indptr, call, chosen)
    return chosen


def shape_class(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    kv_layout: str,
    causal: bool,
    features: str,
) -> ShapeClass:
    """The shape class of one call of :func:`kvcache_torch.attention.attend_pool`.

    ``features`` names the attention features in use (window, softcap, sinks, chunk).
    """
    counts, lengths, many = _batch(page_table, qo_indptr)
    kv_heads = key_cache.shape[{"NHD": 2, "HND": 1, "heads_first": 0}[kv_layout]]
    return ShapeClass.of(
        counts,
        lengths,
        many,
        dtype=str(key_cache.dtype).removeprefix("torch."),
        layout=kv_layout,
        kv_heads=kv_heads,
        group=query.shape[1] // kv_heads,
        head_dim=key_cache.shape[3],
        value_dim=value_cache.shape[3],
        threads=torch.get_num_threads(),
        features=("causal" if causal else "full") + (f"+{features}" if features else ""),
    )


def pool_path(configured: str, device: torch.device) -> str:
    """The path a pool on ``device`` runs, pinned by its config or
    ``KVCACHE_ATTENTION_PATH`` (:func:`~kvcache_core.backends.dispatch.pinned_path`), else ``"auto"``.

    Raises:
        InvalidConfigError: ``KVCACHE_ATTENTION_PATH`` holds an unknown value.
        UnsupportedConfigError: ``attention_path="kernel"`` in the config where the kernel
            cannot run (not a CPU pool, numba missing or switched off: it reads every dtype
            of the torch backend); the reason is named. Pinned by ``KVCACHE_ATTENTION_PATH``, the kernel runs
            where it can.
    """
    path = pinned_path(configured)
    if configured != "kernel":
        return path
    reasons: list[str] = []
    if device.type != "cpu":
        reasons.append(f"the pool is on {device}, the kernel runs on CPU")
    if not paged_kernel.kernel_available():
        reasons.append(f"numba is missing or {paged_kernel.DISABLE_ENV} is set (pip install numba)")
    if reasons:
        raise UnsupportedConfigError(f"attention_path 'kernel' cannot run here: {'; '.join(reasons)}")
    return path


#: Pool dtypes the compiled CPU kernel reads, with their names there.
KERNEL_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def host_view(cache: torch.Tensor) -> npt.NDArray[Any]:
    """A CPU pool as a NumPy view of the same memory (16-bit floats as their ``uint16`` bits)."""
    if cache.dtype == torch.float32:
        return cache.detach().numpy()
    return cache.detach().view(torch.int16).numpy().view(np.uint16)


def kernel_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    scale: float,
    causal: bool,
    kv_layout: str,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor | None:
    """The compiled CPU kernel over the pool read in place (zero-copy NumPy views), with
    ``torch.get_num_threads()`` threads of torch's team; ``None`` where it does not apply (another device,
    another dtype, numba missing or switched off)."""
    dtype = KERNEL_DTYPES.get(key_cache.dtype)
    if dtype is None or key_cache.device.type != "cpu" or not paged_kernel.kernel_available():
        return None
    try:  # attend_with_kernel refuses pools it cannot read in place (kernel_reads): no second check here
        return run_kernel(
            query,
            (host_view(key_cache), host_view(value_cache)),
            page_table,
            qo_indptr,
            dtype,
            kv_layout,
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
        )
    except UnsupportedConfigError:
        return None


def run_kernel(
    query: torch.Tensor,
    pools: tuple[npt.NDArray[Any], npt.NDArray[Any]],
    page_table: PageTable,
    qo_indptr: npt.NDArray[np.int32],
    dtype: str,
    kv_layout: str,
    *,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One call of the compiled kernel on host views of a layer's pools (``dtype``: the
    kernel's name for them; ``scales``: a quantized pool's), with torch's threads; the output
    in ``query``'s dtype.

    Raises:
        UnsupportedConfigError: the kernel cannot read these pools in place, or numba is missing.
    """
    output = paged_kernel.attend_with_kernel(
        query.detach().to(torch.float32).numpy(),
        pools[0],
        pools[1],
        page_table,
        qo_indptr,
        dtype=dtype,
        scale=scale,
        causal=causal,
        kv_layout=kv_layout,
        sliding_window=window,
        num_threads=torch.get_num_threads(),
        team=torch_team(),
        softcap=softcap,
        sinks=None if sinks is None else sinks.detach().to(torch.float32).numpy(),
        chunk=chunk,
        key_scales=None if scales is None else scales[0].numpy(),
        value_scales=None if scales is None else scales[1].numpy(),
    )
    return torch.from_numpy(output).to(query.dtype)  # pyright: ignore[reportUnknownMemberType]


#: Per pair of pools (by identity, checked through weak references: a tensor's ``==`` is
#: elementwise): whether the kernel reads the two in place. A tensor's dtype, shape and
#: strides never change, so this is found once per pair, not once per step.
_READABLE: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], bool]] = {}
_READABLE_KEPT = 1024


def kernel_reads(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel runs on these pools here: a CPU pool of a dtype it reads,
    in place, and numba available."""
    dtype = KERNEL_DTYPES.get(key_cache.dtype)
    if dtype is None or key_cache.device.type != "cpu" or not paged_kernel.kernel_available():
        return False
    key = (id(key_cache), id(value_cache))
    known = _READABLE.get(key)
    if known is not None and known[0]() is key_cache and known[1]() is value_cache:
        return known[2]
    readable = paged_kernel.kernel_reads(dtype, host_view(key_cache), host_view(value_cache))
    if len(_READABLE) >= _READABLE_KEPT:
        _READABLE.clear()  # pools of closed managers: found again once each if still alive
    _READABLE[key] = (weakref.ref(key_cache), weakref.ref(value_cache), readable)
    return readable
