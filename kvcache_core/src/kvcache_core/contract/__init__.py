"""The contract: what every backend, tier and user agrees on.

Protocols (:mod:`.protocols`), the plugin hook specification (:mod:`.hookspecs`), the
configuration values (:mod:`.config`), layer specs and KV-cache groups (:mod:`.groups`), stats
(:mod:`.stats`), block and page tables (:mod:`.block_table`, :mod:`.page_table`), devices,
quantization rules and the number checks every value goes through (:mod:`.scalars`). Nothing
here imports from any other part of the package but :mod:`kvcache_core.errors`.
"""
