"""The bad-input catalogue of attention feature values: windows and chunks past int32,
softcaps and scales that are no normal float32, non-finite sinks. Each case runs on the
pool of :func:`~kvcache_core.testing.world.make_world` where the backend claims the
feature's capability (:class:`~kvcache_core.testing.features.FeatureCases` runs them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kvcache_core.contract.scalars import INT32_MAX
from kvcache_core.errors import InvalidArgumentError
from kvcache_core.testing.backend import BackendUnderTest
from kvcache_core.testing.catalogue import BadCall, attend
from kvcache_core.testing.world import World, esc

__all__ = ["FEATURE_VALUE_CASES"]


def attend_with(**arguments: object) -> Callable[[World], object]:
    """A :func:`attend` call with these (bad) keyword arguments."""
    return lambda w: attend(w, **arguments)


def sinks_of(value: float) -> Callable[[World], object]:
    """A ``paged_attention`` call whose sinks (one per query head of :func:`decode_query`)
    are all ``value``, a native array of the pool's dtype."""
    return lambda w: attend(w, sinks=BackendUnderTest.native(w.manager, np.full(4, value)))


def beyond_int32(name: str, value: int) -> str:
    """The ``match=`` pattern of a window or chunk past int32: the value and the range."""
    return f"{name} must be None or an int >= 1, got {value}; valid: 1 to {INT32_MAX}"


def beyond_float32(name: str, value: float) -> str:
    """The ``match=`` pattern of a scale or softcap that is no normal float32 > 0."""
    return f"{name} must be (None or )?a finite number > 0, got {esc(value)}; valid: .* \\(a normal float32\\)"


#: Attention feature values no backend can represent (or that poison the softmax):
#: windows and chunks past int32, softcaps and scales that are no normal float32,
#: non-finite sinks, on the pool of :func:`~kvcache_core.testing.world.make_world`. Each
#: runs where the backend claims the feature's capability (``requires``).
FEATURE_VALUE_CASES: list[BadCall[World]] = [
    *(
        BadCall(
            f"attention-{name}-{label}",
            attend_with(**{name: value}),
            InvalidArgumentError,
            beyond_int32(name, value),
            requires=(capability,),
        )
        for name, capability in (("window", "attention_window"), ("chunk", "chunked_attention"))
        for label, value in (("past-int32", 2**31), ("2-to-the-70", 2**70))
    ),
    BadCall(
        "attention-window-numpy-bool",
        lambda w: attend(w, window=np.True_),
        InvalidArgumentError,
        "window must be None or an int >= 1, got np.True_",
        requires=("attention_window",),
    ),
    *(
        BadCall(
            f"attention-softcap-{label}",
            attend_with(softcap=value),
            InvalidArgumentError,
            beyond_float32("softcap", value),
            requires=("softcap",),
        )
        for label, value in (
            ("nan", math.nan),
            ("zero", 0.0),
            ("negative", -30.0),
            ("past-float32", 1e39),
            ("below-float32-normal", 1e-46),
        )
    ),
    BadCall(
        "attention-softcap-int-past-float",
        lambda w: attend(w, softcap=10**400),
        InvalidArgumentError,
        "softcap must be None or a finite number > 0, got 1000",
        requires=("softcap",),
    ),
    *(
        BadCall(
            f"attention-sinks-{label}",
            sinks_of(value),
            InvalidArgumentError,
            f"sinks\\[0\\] = {esc(value)}: sinks must be finite",
            requires=("sinks",),
        )
        for label, value in (("nan", math.nan), ("inf", math.inf), ("minus-inf", -math.inf))
    ),
    *(
        BadCall(
            f"attention-scale-{label}",
            attend_with(scale=value),
            InvalidArgumentError,
            beyond_float32("scale", value),
        )
        for label, value in (("past-float32", 1e39), ("below-float32-normal", 1e-46))
    ),
]
