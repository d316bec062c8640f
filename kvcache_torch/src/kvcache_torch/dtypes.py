"""The dtypes the torch backend holds, by the names :class:`~kvcache_core.CacheConfig` uses."""

from __future__ import annotations

import torch

from kvcache_core.errors import UnsupportedConfigError

__all__ = ["HOST_DTYPES", "TORCH_DTYPES", "dtype_name", "torch_dtype"]

#: Pool dtypes of the backend, by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

#: How each pool dtype is held on the host, in NumPy (``blocks_to_host``, ``to_numpy``).
#: NumPy has no bfloat16: it travels as float32, which holds every bfloat16 value exactly,
#: so a round trip through the host is bit-identical (at twice the host memory).
HOST_DTYPES: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a pool dtype name.

    Raises:
        UnsupportedConfigError: a name the backend does not hold (the message lists those it does).
    """
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise UnsupportedConfigError(
            f"the torch backend holds no dtype {name!r}; supported: {', '.join(TORCH_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (any torch dtype, held by the pool or not)."""
    return str(dtype).removeprefix("torch.")
