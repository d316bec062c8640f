"""Paging: the policies over a pool of fixed-size blocks.

The block pool and its reference counts (:mod:`.block_pool`), the allocator's placement
(:mod:`.allocator`), prefix hashing and the chains of cached blocks (:mod:`.prefix`,
:mod:`.chains`), a request's state and its blocks per KV-cache group (:mod:`.request_state`,
:mod:`.sequences`), the checks before any write (:mod:`.checks`), the invariant audit
(:mod:`.audit`) and the pool's figures for stats (:mod:`.figures`). Imports only the contract
and attention's feature rules.
"""
