"""Which torch device a pool lives on: :func:`resolve_device`."""

from __future__ import annotations

import torch

from kvcache_core.contract.config import CacheConfig
from kvcache_core.errors import UnsupportedConfigError

__all__ = ["resolve_device"]


def resolve_device(config: CacheConfig) -> torch.device:
    """The torch device of ``config.device``, checked to be present here.

    Raises:
        UnsupportedConfigError: a CUDA device without a usable GPU, or an index past the
            last GPU (the message says how many there are).
    """
    device = config.device
    if device.kind == "cpu":
        return torch.device("cpu")
    if device.kind == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedConfigError(
                f"device {str(device)!r} is not available: torch {torch.__version__} sees no CUDA GPU here; "
                "use device 'cpu'"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise UnsupportedConfigError(
                f"device {str(device)!r} is not available: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    raise UnsupportedConfigError(f"the torch backend supports devices cpu and cuda, got {str(device)!r}")
