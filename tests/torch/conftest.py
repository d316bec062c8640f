"""Fixtures of the torch backend's tests: every device (CUDA skipped cleanly without a GPU).
The helpers they share live in ``tests.torch.support``."""

from __future__ import annotations

import pytest

from tests.torch.support import DEVICES


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Every device the backend supports; CUDA is skipped with a reason where absent."""
    value: str = request.param
    return value
