"""Hugging Face transformers integration: a ``Cache`` backed by a kvcache paged pool.

Two pieces, used together or apart::

    import kvcache_torch.hf  # registers the "kvcache_paged" attention implementation
    from kvcache_core import create_manager
    from kvcache_torch.hf import PagedCache, cache_config_for

    model = AutoModelForCausalLM.from_pretrained(name)  # "sdpa": the cache switches it
    manager = create_manager("torch", cache_config_for(model, max_tokens=16384))
    with PagedCache(manager, model) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before 5.x

- :class:`PagedCache` is a ``transformers.Cache`` whose K/V live in the manager's pool: one
  kvcache request per batch row, allocated at the first forward.
- The ``"kvcache_paged"`` attention implementation (registered on import, or with
  :func:`register_attention`) writes each layer's new K/V into the pool in one batched write
  and runs paged attention on the pool directly: decode never rebuilds a contiguous K/V.
  Each forward is one manager step (``begin_step``): planned once at the first layer (every
  row grown by its real new tokens, atomically), then written and attended per layer. The write happens in the attention function rather
  than in ``update`` because only the attention function sees the padding mask: padding tokens (zeros of the
  2-D ``attention_mask``) are never stored, so each request holds exactly its real tokens
  and a left-padded batch gives the same logits at the real positions as ``DynamicCache``.
  A first forward without padding attends over its own new K/V with transformers' ``sdpa``
  (they are the whole context and contiguous already; measured faster than reading them
  back from the pool); every later forward (decode, chunked prefill) reads the pool.
- A cache built with the model (``PagedCache(manager, model)``, ``attention="auto"``) runs
  each forward of a plain decoder on its default attention (``"sdpa"``, or ``"eager"`` for a
  class without it) whose attention calls transformers' interface
  with ``"kvcache_paged"``, and puts the model's attention back after it
  (:mod:`~kvcache_torch.hf.attention_choice`); ``attention="model"`` keeps the model's own.
- ``"kvcache_paged"`` serves models whose attention calls transformers' attention interface.
  One that computes attention itself (Bloom, MPT, XGLM, ...) or rejects the name at load
  (Falcon, GPT-Neo, GIT) is refused by name with its remedy, by :func:`cache_config_for` and
  :class:`PagedCache` where transformers can tell from the class, else at its first forward
  before anything is stored (:mod:`kvcache_torch.hf.guard`).
- With any other implementation (``"sdpa"``, ``"eager"``, ...) :meth:`PagedCache.update`
  stores every position and returns the contiguous K/V ``[batch, kv_heads, tokens,
  head_dim]`` the model expects: slower, but any model works. A sliding (or chunked) layer
  gets what ``DynamicCache``'s ``DynamicSlidingWindowLayer`` returns, its last ``W - 1``
  positions and the new ones, with the mask sizes it reports, so a pool whose sliding layers
  keep only their window's blocks serves this path too. The ``"kvcache_paged"``
  attention with another cache (or none) runs ``sdpa`` on what it is given.
- State-space and linear-attention hybrids (Mamba2, Bamba, Granite 4 hybrid, Jamba,
  Qwen3-Next, LFM2; :mod:`kvcache_torch.hf.state_layers`): each row's conv and recurrent
  states live in the pool's state slots (one per row), the attention layers' K/V in its
  blocks; ``crop`` of such a model is refused (``StateRollbackError``) unless it goes back
  to a state checkpoint.
- Beam search (``reorder_cache``), ``batch_repeat_interleave`` and ``batch_select_indices``
  move requests between rows and ``fork`` a request for each row that duplicates another:
  the rows share every block, and only the block a beam goes on to write in is copied
  (copy-on-write, by the next step). ``crop`` (rollback, assisted generation) truncates each
  request (``manager.truncate``): the blocks past its new end are free at once.
- Layers that reuse an earlier layer's K/V (Gemma 3n's ``num_kv_shared_layers``) keep no
  blocks: the pool holds the layers that store K/V, and a reusing layer attends over its
  source's (:mod:`~kvcache_torch.hf.shared_kv`).
- Prefix caching through ``generate`` alone: ``PagedCache(manager, model)`` (the model, not
  only its config) registers a forward pre-hook that hands each forward's token ids to the
  cache (:mod:`~kvcache_torch.hf.prompts`): a new batch starts from the cached blocks of its
  prompts and computes only the rest; ``map_cached_prefix`` does it by hand.
- Disaggregated prefill and decode (``examples/disaggregated.py``): a prefill worker runs
  ``generate(..., max_new_tokens=1)`` on a ``PagedCache`` and exports its request
  (``cache.flush_states()``, then ``KvTransferAgent.export(cache.handles[0])``: a hybrid
  model's last states go to the request's slot first); a decode worker imports it
  (``import_request``) and builds ``PagedCache(manager, model, handles=[handle])``, a cache
  that holds the prompt already; ``generate`` on the prompt and the first token then
  computes one token per step and never the prompt's K/V.
- Only public core API is used: the step, ``fork``, ``truncate``, ``gather``; the pool's
  policies (free-block accounting, copies, tables) stay in core.

Tested with transformers 5.24 (``cache=``) and, by hand, 4.56 and 4.57
(``past_key_values=``).

Lifecycle: the requests (and their blocks) live until :meth:`PagedCache.release` (also
``close()``, ``reset()``, leaving a ``with`` block, or the cache being garbage-collected).
Passing the same cache to a second ``generate`` *continues* its sequences, as with
``DynamicCache``; release it (or use a new one) to start over.

Where the parts live: :mod:`~kvcache_torch.hf.model_config` (what a transformers config
says: geometry, layer specs, :func:`cache_config_for`, :func:`model_fingerprint`),
:mod:`~kvcache_torch.hf.cache` (:class:`PagedCache`), :mod:`~kvcache_torch.hf.layer`
(:class:`PagedCacheLayer`), :mod:`~kvcache_torch.hf.rows` (the requests behind the batch
rows), :mod:`~kvcache_torch.hf.forward_pass` (a forward's step, each layer's positions, the
hand-off from ``update`` to the attention), :mod:`~kvcache_torch.hf.padding`,
:mod:`~kvcache_torch.hf.attention` (the ``"kvcache_paged"`` implementation),
:mod:`~kvcache_torch.hf.attention_choice` (which attention a cache's forwards run),
:mod:`~kvcache_torch.hf.prompts` (token ids from the model to the pool),
:mod:`~kvcache_torch.hf.shared_kv` (layers reusing others' K/V) and
:mod:`~kvcache_torch.hf.guard` (which models it serves).
"""

from __future__ import annotations

from kvcache_torch.hf.attention import paged_attention_forward, paged_attention_mask, register_attention
from kvcache_torch.hf.cache import PagedCache
from kvcache_torch.hf.layer import PagedCacheLayer
from kvcache_torch.hf.model_config import ATTN_IMPLEMENTATION, cache_config_for, model_fingerprint

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PagedCache",
    "PagedCacheLayer",
    "cache_config_for",
    "model_fingerprint",
    "paged_attention_forward",
    "paged_attention_mask",
    "register_attention",
]

register_attention()
