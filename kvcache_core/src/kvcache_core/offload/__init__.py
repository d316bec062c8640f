"""Offload: everything that leaves the pool or the process.

The portable record format (:mod:`.host_form`, :mod:`.file_tensors`, :mod:`.file_header`), the
tiers (:mod:`.tiers`), their guard (:mod:`.guarded_tiers`) and the stack of tiers under a pool
(:mod:`.tier_stack`), the prefix-cache file (:mod:`.prefix_file`), cache events and their
publisher (:mod:`.events`, :mod:`.publisher`), and the file and JSON rules they share
(:mod:`.safe_files`, :mod:`.strict_json`); beyond one process, the tier a fleet shares on a
Redis server (:mod:`.redis_tier`, :mod:`.redis_writer`), the router by cached prefix
(:mod:`.router`) and where a prompt's prefix is (:mod:`.explain`). Imports the contract and
paging, never the manager.
"""
