"""The slowest tests run at the size ``KVCACHE_TEST_SIZE`` chooses (``tests.sizes``)."""

from __future__ import annotations

import pytest

from tests import sizes


@pytest.mark.parametrize(("environ", "expected"), [({}, "everyday"), ({"KVCACHE_TEST_SIZE": ""}, "everyday")])
def test_the_everyday_size_is_the_default(environ: dict[str, str], expected: str) -> None:
    assert sizes.chosen_size(environ) == expected


@pytest.mark.parametrize("size", sizes.SIZES)
def test_each_size_is_chosen_by_name(size: str) -> None:
    assert sizes.chosen_size({"KVCACHE_TEST_SIZE": size}) == size


def test_an_unknown_size_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"KVCACHE_TEST_SIZE must be one of everyday, full \(or unset\), got 'huge'"):
        sizes.chosen_size({"KVCACHE_TEST_SIZE": "huge"})


def test_sized_gives_the_full_size_only_in_a_full_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizes, "FULL", True)
    assert sizes.sized(full=300, everyday=100) == 300
    monkeypatch.setattr(sizes, "FULL", False)
    assert sizes.sized(full=300, everyday=100) == 100
