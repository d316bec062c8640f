"""Paging: the policies over a pool of fixed-size blocks.

The block pool and its reference counts (:mod:`.block_pool`), the allocator's placement
(:mod:`.allocator`), prefix hashing and the chains of cached blocks (:mod:`.prefix`,
:mod:`.chains`), a request's state and its blocks per KV-cache group (:mod:`.request_state`,
:mod:`.sequences`), the one plan of a new request's prefix hit in the pool and the tiers
(:mod:`.planner`), the checks before any write (:mod:`.checks`), the invariant audit
(:mod:`.audit`) and the pool's figures for stats (:mod:`.figures`). Imports only the contract
and attention's feature rules.

The policies of :class:`~kvcache_core.PagedKvCacheManager`, the same for every backend (they
move bytes only through ``KvStorage``):

* **prefix caching** (``CacheConfig(enable_prefix_caching=True)``): a full block whose K/V
  are written is hashed (chained with its prefix, see :mod:`kvcache_core.paging.prefix`);
  ``allocate`` maps the cached full blocks of ``AllocationRequest.prompt_token_ids`` and
  starts the sequence after them: every cached full block of the prompt is mapped (shared,
  not copied), at most ``(len(prompt) - 1) // block_size`` of them so that the last prompt
  token is always computed; the sequence then starts at the cached tokens
  (``handle.num_tokens() == handle.num_cached_tokens()``). Blocks nobody references stay cached until evicted,
  least recently used first; blocks without a hash are always reused first. A block is
  hashed and findable by later requests once (1) it is full (``extend`` handed out all its
  positions), (2) the token ids of all its positions are known (from
  ``AllocationRequest.prompt_token_ids`` or ``extend(..., token_ids=...)``), (3) every one
  of its slots has been written through ``write`` in every layer, and (4) the block before
  it is hashed. The manager tracks the writes itself; the caller marks nothing.
* **fork with copy-on-write**: :meth:`PagedKvCacheManager.fork` shares blocks; the first
  slot handed out in a shared block (``extend``, ``writable_slots``) copies that block.
  Forking copies nothing: each shared block's reference count rises by one, and the first
  slot handed out in a shared block (for either request) copies that block alone; the two
  requests then diverge without seeing each other's writes. The parent's reserved empty
  blocks stay the parent's.
* **rewriting** (``writable_slots``): a block registered in the prefix cache is immutable:
  one the request holds alone leaves the prefix cache (its hash is unregistered) before any
  slot is handed out, and a shared one is copied (the copy is not registered). The
  request's own hash chain stops before the first of its hashed blocks in the range, so it
  never registers K/V a rewrite may have changed.
* **truncation** (``truncate``): blocks wholly past the new end are released at once
  (reserved ones too): a block holding a cached prefix stays cached, a shared one stays
  with its other holders. The block the new end falls in keeps its first tokens; if it was
  registered in the prefix cache and the request holds it alone it leaves the cache (the
  request will write new tokens into it), and if it is shared the next ``extend`` copies
  it. The request's hash chain and token ids are cut to the new length.
* **swapping**: ``swap_out`` copies a request's blocks to host memory
  (``storage.blocks_to_host``) and releases them: the request drops its reference on
  every block it held; a block shared with another request (fork, prefix hit) stays with
  that request, a block holding a cached prefix stays cached, the rest become free.
  ``swap_in`` brings them back, bit-identical, into any free blocks.
* **sliding window** (``CacheConfig(sliding_window=W)``): blocks wholly older than the
  window of the next token are released as a request grows; attention masks the rest.
  ``extend`` releases the blocks wholly older than the window of the first new token first:
  the request keeps the blocks of positions ``num_tokens() - W + 1`` onwards, so one
  growing a token per step never holds more than ``ceil(W / block_size) + 1`` blocks
  (beyond what ``initial_tokens`` reserved ahead). Queries attending after an ``extend``
  should be the new tokens': an earlier token's window may reach into released blocks.
* **hybrid models** (``CacheConfig(layer_specs=...)``): layers that keep the same blocks
  form KV-cache groups (:mod:`kvcache_core.contract.groups`); a request has a block table per
  group over the one pool, every policy above runs over all of them, and a prefix hit
  maps blocks in every group or in none.
* **recurrent states** (``LayerSpec(state=...)``): a request holds one state slot
  (:mod:`.state_slots`) for every state array of every layer keeping a state, whether it
  keeps K/V besides (``keeps_kv=True``) or not; fork copies the slot, swap carries it,
  a prefix hit starts from the checkpoint filed at the hit's last block, and ``truncate``
  goes back only to such a checkpoint. A checkpoint leaves the pool for an offload tier
  with its block, and a hit through the tiers stops at the last block whose checkpoint
  the pool or a tier holds (it is written into the new request's slot). A layer keeping nothing (``keeps_kv=False``
  without a state) takes part in no policy.
"""
