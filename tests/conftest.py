"""Shared test configuration: Hypothesis profiles and small fixtures."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Shared CI machines are noisy: no deadlines. "ci" is derandomized so a run is repeatable.
settings.register_profile("default", deadline=None)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
