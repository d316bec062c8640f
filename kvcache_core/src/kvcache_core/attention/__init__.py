"""Attention over a paged pool.

The NumPy reference (:mod:`.reference`: :func:`paged_attention` and the argument checks every
backend shares), the attention features and their masking rules (:mod:`.features`: window,
softcap, sinks, chunk) and the compiled CPU kernel (:mod:`.kernel`). Imports only the contract.
``from kvcache_core.attention import paged_attention`` is the reference's public face.
"""

from __future__ import annotations

from kvcache_core.attention.reference import (
    check_attention_call,
    check_scale,
    decode_indptr,
    paged_attention,
    validate_query_indptr,
)

__all__ = ["check_attention_call", "check_scale", "decode_indptr", "paged_attention", "validate_query_indptr"]
