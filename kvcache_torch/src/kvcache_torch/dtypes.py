"""The dtypes the torch backend holds, by the names :class:`~kvcache_core.CacheConfig` uses."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt
import torch

from kvcache_core.errors import UnsupportedConfigError
from kvcache_torch.spec import DTYPES

__all__ = ["BIT_DTYPES", "TORCH_DTYPES", "VALUE_DTYPES", "dtype_name", "tensor_of", "torch_dtype"]

#: Pool dtypes of the backend, by name: those :data:`kvcache_torch.spec.DTYPES` claims, each
#: torch's dtype of that name.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}

#: The dtype ``to_numpy`` gives a tensor's *values* in, where NumPy lacks the tensor's own:
#: bfloat16 values as float32, which holds each of them exactly.
VALUE_DTYPES: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.float32}

#: The same-width integer dtype whose NumPy arrays carry a dtype NumPy lacks, bit for bit:
#: bfloat16 blocks leave as their 16-bit patterns (core's host form, ``uint16`` in NumPy;
#: :mod:`kvcache_core.offload.host_form`), never through float values.
BIT_DTYPES: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}


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
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


#: Names already made (a dtype per entry: a few dozen at most).
_NAMES: dict[torch.dtype, str] = {}


def tensor_of(array: npt.NDArray[Any]) -> torch.Tensor:
    """``torch.from_numpy``, typed; a read-only array is copied (torch has no read-only tensors)."""
    if not array.flags.writeable:
        array = array.copy()
    tensor: torch.Tensor = torch.from_numpy(array)  # pyright: ignore[reportUnknownMemberType]
    return tensor
