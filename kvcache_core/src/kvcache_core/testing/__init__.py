"""The conformance kit for kvcache backends: a pytest plugin and a test base class.

Run it against every installed backend, or one::

    pytest -p kvcache_core.testing --kvcache-backend numpy --pyargs kvcache_core.testing.test_conformance

or subclass :class:`KvCacheConformance` in one test file of your own backend::

    import pytest
    from kvcache_core.testing import KvCacheConformance

    @pytest.mark.kvcache_backends("mine")
    class TestMine(KvCacheConformance):
        pass

Besides the Protocol members and their signatures, the kit checks what every storage
method returns (:mod:`kvcache_core.testing.returns`), the data path, attention, the
policies a backend claims in ``BackendSpec.capabilities`` (the summary lists those it does
not claim and the tests skipped for that; ``--kvcache-require-all`` fails them), closing,
bad inputs (:mod:`~kvcache_core.testing.catalogue`, the policies' in
:mod:`~kvcache_core.testing.policy_catalogue`) and threads. Runs are repeatable
(``--kvcache-seed``, default 0, no Hypothesis example database) and every failure ends
with a ``reproduce:`` command to paste. :class:`TierCases` is the same for offload tiers:
any :class:`~kvcache_core.offload.tiers.OffloadTier` runs it (with a fault injected at every tier
and storage call) by subclassing it with a ``kvcache_tier_factory`` fixture;
``KvCacheConformance`` runs it with ``HostTier``. For a backend's own attention tests,
:func:`kvcache_core.testing.oracle.dense_attention` is textbook dense attention in float64.

The plugin registers itself through the ``pytest11`` entry point of kvcache-core and stays
inert until a test uses the ``kvcache_backend`` fixture. Importing this package imports
neither hypothesis nor any backend's array library; the suite loads on first use of
:class:`KvCacheConformance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

# Before the kit's modules load: failures inside them show the compared values.
pytest.register_assert_rewrite(
    "kvcache_core.testing.suite",
    "kvcache_core.testing.machine",
    "kvcache_core.testing.catalogue",
    "kvcache_core.testing.policy_catalogue",
    "kvcache_core.testing.policies",
    "kvcache_core.testing.world",
    "kvcache_core.testing.reliability",
    "kvcache_core.testing.backend",
    "kvcache_core.testing.tiers",
    "kvcache_core.testing.feature_catalogue",
    "kvcache_core.testing.host_forms",
    "kvcache_core.testing.states",
    "kvcache_core.testing.mixed_layers",
    "kvcache_core.testing.value_widths",
    "kvcache_core.testing.layer_geometry",
)

from kvcache_core.testing._plugin import (  # noqa: E402  (after the rewrite registration)
    KitSettings,
    kit_settings,
    kvcache_backend,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

if TYPE_CHECKING:
    from kvcache_core.testing.backend import BackendUnderTest
    from kvcache_core.testing.suite import KvCacheConformance
    from kvcache_core.testing.tiers import TierCases

__all__ = [
    "BackendUnderTest",
    "KitSettings",
    "KvCacheConformance",
    "TierCases",
    "kit_settings",
    "kvcache_backend",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_makereport",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
]


def __getattr__(name: str) -> Any:
    if name == "KvCacheConformance":
        from kvcache_core.testing.suite import KvCacheConformance

        return KvCacheConformance
    if name == "TierCases":
        from kvcache_core.testing.tiers import TierCases

        return TierCases
    if name == "BackendUnderTest":
        from kvcache_core.testing.backend import BackendUnderTest

        return BackendUnderTest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
