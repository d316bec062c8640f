"""The padding of a batch: which new tokens are real, and the real tokens' K/V in the
token-major layout the pool takes."""

from __future__ import annotations

import torch

from kvcache_core.errors import ShapeMismatchError

__all__ = ["left_padded_lengths", "real_tokens", "token_major"]


def token_major(states: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, heads, tokens, dim]`` -> ``[stored tokens, heads, dim]``, rows in order,
    keeping the ``valid`` tokens only (all when ``None``)."""
    if valid is None and states.shape[2] == 1:  # a decode step: one token per row, no copy
        rows = states.squeeze(2)
        return rows if rows.is_contiguous() else rows.contiguous()
    transposed = states.transpose(1, 2)
    if valid is None:
        return transposed.reshape(-1, states.shape[1], states.shape[3]).contiguous()
    return transposed[valid].contiguous()


def left_padded_lengths(valid: torch.Tensor) -> list[int] | None:
    """Each row's count of real tokens when every row of ``valid [batch, tokens]`` is
    padding then real tokens (left padding), else ``None``."""
    counts = valid.sum(dim=1)
    positions = torch.arange(valid.shape[1], device=valid.device)
    if not torch.equal(positions[None, :] >= (valid.shape[1] - counts)[:, None], valid):
        return None
    return [int(count) for count in counts]


def real_tokens(
    attention_mask: torch.Tensor | None, kv_length: int, query_length: int, batch: int
) -> torch.Tensor | None:
    """Which new tokens are real (not padding), ``[batch, query_length]`` bool, or ``None``
    when all are, from the 2-D mask the ``kvcache_paged`` mask function passes on.

    Raises:
        ShapeMismatchError: a mask other than ``[batch, kv_length]``.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] != kv_length:
        raise ShapeMismatchError(
            f"kvcache_paged attention needs the 2-D padding mask [batch={batch}, positions={kv_length}] "
            f"(cached plus new), got {tuple(attention_mask.shape)}"
        )
    new = attention_mask[:, kv_length - query_length :].to(torch.bool)
    return None if bool(new.all()) else new
