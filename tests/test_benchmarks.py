"""Every benchmark still runs: each script's ``--quick`` smoke run exits 0 and prints ratios;
and the harness they share (``benchmarks/_harness``) takes turns, checks and refuses as it says.

No time is asserted (shared machines are noisy); the scripts themselves exit 1 when the
compared implementations disagree, so this also checks they compute the same thing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache_core.backends.dispatch import DispatchChoice
from tests.workers import usable_cpus, worker_thread_environment

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_"))


def load_module(name: str, path: Path, *, package_folder: Path | None = None) -> Any:
    """The module at ``path``, imported under ``name`` and registered in ``sys.modules`` (the
    dataclasses of a module look it up there; a package's modules import each other
    relatively); ``package_folder`` makes it a package searched there."""
    search = None if package_folder is None else [str(package_folder)]
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def bench_environment() -> Any:
    """The harness's environment module, ``benchmarks/_harness/environment.py`` (standard library
    only; the benchmarks are a folder of scripts, not a package)."""
    return load_module("benchmarks_environment", BENCHMARKS / "_harness" / "environment.py")


@functools.cache
def bench_harness() -> Any:
    """The harness package the scripts import as ``_harness`` (from their own folder)."""
    folder = BENCHMARKS / "_harness"
    return load_module("_harness", folder / "__init__.py", package_folder=folder)


def test_every_benchmark_is_listed_here() -> None:
    assert SCRIPTS == [
        "allocator_runs.py",
        "decode_jax.py",
        "decode_numpy.py",
        "decode_torch.py",
        "decode_torch_batch.py",
        "decode_torch_hybrid.py",
        "fleet.py",
        "generate_hybrid.py",
        "generate_torch.py",
        "handoff.py",
        "hybrid_memory.py",
        "memory_gemma4.py",
        "memory_hybrid.py",
        "memory_mla.py",
        "prefix.py",
        "prefix_tiers.py",
        "quantized.py",
        "step_cold.py",
        "step_overhead.py",
        "transfer.py",
    ]


def _missing_extra(script: str) -> str | None:
    """Why ``script`` cannot run here (an optional extra it needs is not installed), or ``None``."""
    if script not in ("handoff.py", "transfer.py"):
        return None
    try:
        from kvcache_core.transfer import nixl_unavailable_reason
    except ImportError as exc:  # pyzmq or msgpack missing
        return str(exc)
    return nixl_unavailable_reason()


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_run_succeeds_and_prints_ratios(script: str) -> None:
    missing = _missing_extra(script)
    if missing is not None:
        pytest.skip(f"{script} needs the transfer extra: {missing}")
    environment = {
        **os.environ,
        **bench_environment().RECOMMENDED_ENV,
        "HF_HUB_OFFLINE": "1",
        **worker_thread_environment(os.environ, usable_cpus()),
    }
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
        timeout=600,
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "x" in result.stdout
    assert any(character.isdigit() for character in result.stdout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_help_prints_its_options(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout
    assert "--quick" in result.stdout


def test_bench_parser_prints_a_percent_in_help_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    parser = bench_harness().BenchParser("A benchmark.", quick="fewer repeats")
    parser.flag("--repeats", (6, 2), help="timed runs (6 or more give a 95 % interval)")

    with pytest.raises(SystemExit):
        parser.parse(["--help"])

    assert "95 % interval" in capsys.readouterr().out


def test_take_turns_rotates_the_order_each_round_and_times_after_the_warmup() -> None:
    harness = bench_harness()
    order: list[str] = []
    competitors = {name: functools.partial(order.append, name) for name in ("a", "b", "c")}

    timings = harness.take_turns(competitors, rounds=2, warmup=1)

    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {name: len(samples) for name, samples in timings.samples.items()} == {"a": 2, "b": 2, "c": 2}


def test_cold_turns_evicts_before_every_piece_and_subtracts_what_is_excluded() -> None:
    harness = bench_harness()
    log: list[str] = []
    excluded = [0.0]

    def pieces(name: str) -> list[Any]:
        def piece(index: int) -> Any:
            def run() -> None:
                log.append(f"{name}{index}")
                excluded[0] += 1000.0  # far more than the piece's time: the sample goes negative

            return run

        return [piece(0), piece(1)]

    timings = harness.cold_turns(
        {"a": lambda: pieces("a"), "b": lambda: pieces("b")},
        rounds=2,
        warmup=1,
        evict=lambda: log.append("evict"),
        excluded=lambda: excluded[0],
    )

    round_a_first = ["evict", "a0", "evict", "a1", "evict", "b0", "evict", "b1"]
    round_b_first = round_a_first[4:] + round_a_first[:4]
    assert log == round_a_first + round_b_first + round_a_first
    assert {name: len(samples) for name, samples in timings.samples.items()} == {"a": 2, "b": 2}
    assert all(-2000.0 < sample < -1999.0 for samples in timings.samples.values() for sample in samples)


def test_cold_turns_keeps_each_pieces_samples_when_asked() -> None:
    harness = bench_harness()

    timings = harness.cold_turns(
        {"a": lambda: [lambda: None, lambda: None]}, rounds=3, warmup=1, evict=lambda: None, per_piece=True
    )

    assert {name: len(samples) for name, samples in timings.samples.items()} == {"a": 3, "a[0]": 3, "a[1]": 3}
    for total, first, second in zip(*(timings.samples[name] for name in ("a", "a[0]", "a[1]")), strict=True):
        assert total == pytest.approx(first + second)


def test_take_turns_checks_every_round_and_stops_at_a_disagreement() -> None:
    harness = bench_harness()
    seen: list[tuple[dict[str, int], int]] = []

    def check(results: dict[str, int], index: int) -> None:
        seen.append((dict(results), index))
        harness.require(index < 1, "round 1 differs")

    with pytest.raises(harness.DisagreementError, match="round 1 differs"):
        harness.take_turns({"x": lambda: 7}, rounds=3, warmup=1, check=check)
    assert seen == [({"x": 7}, 0), ({"x": 7}, 1)]


def test_timings_give_the_chosen_statistic() -> None:
    harness = bench_harness()
    samples = {"x": [0.003, 0.001, 0.002, 0.010]}

    assert harness.Timings(samples).ms("x") == pytest.approx(2.5)
    assert harness.Timings(samples, "min").ms("x") == pytest.approx(1.0)


def test_paired_ratio_gives_the_median_and_an_order_statistic_interval() -> None:
    harness = bench_harness()
    # Round i: the other took 1.0 + i / 10 s, ours 1 s; unsorted rounds, drift cancelled by pairing.
    others = [1.3, 1.0, 1.8, 1.1, 1.5, 1.2, 1.7, 1.4, 1.6]
    drift = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0]  # the machine's speed, the same for both in a round

    paired = harness.paired_ratio([o * d for o, d in zip(others, drift, strict=True)], drift)

    assert paired.median == pytest.approx(1.4)
    # 9 rounds: the 2nd to the 8th ratio holds the median with probability 1 - 2 * 10 / 512.
    assert (paired.low, paired.high) == (pytest.approx(1.1), pytest.approx(1.7))
    assert paired.coverage == pytest.approx(1 - 20 / 512)
    assert (paired.verdict(1.05), paired.verdict(1.5), paired.verdict(1.75)) == (
        "met",
        "undecided (the interval spans it)",
        "NOT met",
    )
    assert [paired.verdict(bound, at_most=True) for bound in (1.75, 1.5, 1.05)] == [
        "met",
        "undecided (the interval spans it)",
        "NOT met",
    ]
    assert str(paired) == "1.40x [1.10x, 1.70x]"


def test_paired_ratio_with_few_rounds_spans_them_all_at_its_lower_coverage() -> None:
    harness = bench_harness()

    five = harness.paired_ratio([2.0, 3.0, 1.0, 5.0, 4.0], [1.0] * 5)
    one = harness.paired_ratio([2.0], [1.0])

    assert (five.low, five.high, five.coverage) == (1.0, 5.0, pytest.approx(1 - 2 / 32))
    assert (one.low, one.high, one.coverage) == (2.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="as many numerators as denominators"):
        harness.paired_ratio([1.0], [1.0, 2.0])


def test_agreement_check_refuses_outputs_beyond_the_tolerance() -> None:
    harness = bench_harness()
    check = harness.agreement_check("ours", {"dense": "dense"}, what="1 x 8")
    ours = [np.zeros(4, np.float32)]

    check({"ours": ours, "dense": [np.full(4, 1e-6, np.float32)]}, 1)
    with pytest.raises(harness.DisagreementError, match=r"ours vs dense by 1\.000e-03"):
        check({"ours": ours, "dense": [np.full(4, 1e-3, np.float32)]}, 1)


def test_run_turns_a_disagreement_into_exit_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    harness = bench_harness()

    def main() -> int:
        raise harness.DisagreementError("ours vs dense by 1e-2")

    assert harness.run(main) == 1
    assert "error: ours vs dense by 1e-2" in capsys.readouterr().err


def test_bench_parser_applies_the_quick_or_the_full_default() -> None:
    parser = bench_harness().BenchParser("A benchmark.", quick="fewer repeats")
    parser.flag("--repeats", (9, 3), help="timed steps")

    assert parser.parse([]).repeats == 9
    assert parser.parse(["--quick"]).repeats == 3
    assert parser.parse(["--quick", "--repeats", "5"]).repeats == 5


def test_bench_parser_refuses_query_heads_not_a_multiple_of_kv_heads() -> None:
    parser = bench_harness().BenchParser("A benchmark.", quick="smaller")
    parser.geometry(query_heads=32, kv_heads=8)

    with pytest.raises(SystemExit):
        parser.parse(["--query-heads", "12"])


def test_environment_banner_names_the_machine_and_the_libraries(capsys: pytest.CaptureFixture[str]) -> None:
    bench_environment().print_environment()

    printed = capsys.readouterr().out
    for expected in ("machine:", "usable cores", "caches", "Python", "numpy", "torch", "numba", "recommended"):
        assert expected in printed


def test_dispatch_listing_names_each_class_its_path_and_times(capsys: pytest.CaptureFixture[str]) -> None:
    choices = {
        "in-model decode requests<=1": DispatchChoice("native", {"kernel": 150e-6, "native": 100e-6}),
        "prefill requests<=8": DispatchChoice("kernel", {"kernel": 0.002, "native": 0.0021}, settled=False),
    }
    bench_environment().print_dispatch(choices)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "  in-model decode requests<=1: native (kernel 150 us, native 100 us; decisive: kept on disk)",
        "  prefill requests<=8: kernel (kernel 2000 us, native 2100 us; within the noise: held for this run)",
    ]
    bench_environment().print_dispatch({})
    assert "none measured" in capsys.readouterr().out
