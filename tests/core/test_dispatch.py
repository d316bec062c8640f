"""The attention dispatch (kvcache_core.backends.dispatch): shape classes, calibration, the
calibration file (strict, per machine, atomic), pins."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcache_core import CacheConfig, create_manager
from kvcache_core.attention import kernel as paged_kernel
from kvcache_core.backends import dispatch, dispatch_files
from kvcache_core.backends.dispatch import AttentionDispatch, ShapeClass
from kvcache_core.cli import main as cli_main
from kvcache_core.errors import InvalidArgumentError, InvalidConfigError, InvalidTypeError, UnsupportedConfigError

LIBRARIES = {"kvcache-core": "test", "lib": "1"}
#: The calibration file of backend "test" under LIBRARIES on this machine.
FILE = dispatch.dispatch_file_name("test", dispatch.machine_key(LIBRARIES))


def shape(**changes: object) -> ShapeClass:
    base: dict[str, Any] = {
        "dtype": "float32",
        "layout": "heads_first",
        "kv_heads": 2,
        "group": 4,
        "head_dim": 64,
        "value_dim": 64,
        "threads": 2,
        "features": "causal",
    }
    base.update(changes)
    return ShapeClass.of([1], [2048], False, **base)


class Clock:
    """``time.perf_counter`` for a calibration: each path's call advances it by its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def path(self, cost: float, output: str, log: list[str]) -> Callable[[], str]:
        def call() -> str:
            self.now += cost
            log.append(output)
            return output

        return call


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_shape_classes_bucket_what_decides_the_winner() -> None:
    decode = ShapeClass.of([1, 1, 0], [300, 1000, 5], False, **_geometry())
    assert (decode.phase, decode.requests, decode.context, decode.runs) == ("decode", 2, 1024, "one")
    prefill = ShapeClass.of([40], [40], True, **_geometry())
    assert (prefill.phase, prefill.context, prefill.runs) == ("prefill", 256, "many")
    mixed = ShapeClass.of([3, 1], [100, 7000], False, **_geometry())
    assert (mixed.phase, mixed.requests, mixed.context) == ("mixed", 2, 8192)
    assert ShapeClass.of([1], [3000], False, **_geometry()).key == ShapeClass.of([1], [4096], False, **_geometry()).key
    assert ShapeClass.of([1], [3000], False, **_geometry()).key != ShapeClass.of([1], [5000], False, **_geometry()).key


def _geometry() -> dict[str, Any]:
    return {
        "dtype": "float32",
        "layout": "NHD",
        "kv_heads": 2,
        "group": 1,
        "head_dim": 8,
        "value_dim": 8,
        "threads": 1,
        "features": "causal",
    }


def test_the_faster_path_wins_once_and_is_kept_on_disk(tmp_path: Path, clock: Clock) -> None:
    log: list[str] = []
    paths = {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)}
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)

    assert chooser.run(shape(), paths) == "n"  # the winner's output
    assert log.count("k") == 1 + dispatch.CALIBRATION_ROUNDS
    choice = chooser.choice(shape())
    assert choice is not None
    assert choice.path == "native"
    assert choice.settled
    assert choice.seconds == pytest.approx({"kernel": 0.002, "native": 0.001})
    log.clear()
    assert chooser.run(shape(), paths) == "n"
    assert log == ["n"]  # measured once: later calls run the choice

    again = AttentionDispatch("test", LIBRARIES, tmp_path)  # a later process reads the file
    assert again.run(shape(), paths) == "n"
    assert log == ["n", "n"]
    stored = json.loads((tmp_path / FILE).read_text())
    assert stored["machine"] == dispatch.machine_key(LIBRARIES)
    assert list(stored["choices"]) == [shape().key]
    assert not [name for name in os.listdir(tmp_path) if name != FILE]  # no temporary left


def in_model(**changes: object) -> ShapeClass:
    return dataclasses.replace(shape(**changes), measured="model")


def test_a_class_measured_as_the_model_runs_it_takes_turns_then_keeps_the_faster(tmp_path: Path) -> None:
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    decode = in_model()
    assert decode.key == "in-model " + shape().key  # a class of its own beside the loop's
    turns: list[str] = []
    for _ in range(2 * dispatch.TRIAL_STEPS):
        path = chooser.trial_path(decode, ("kernel", "native"))
        turns.append(path)
        layer_seconds = {"kernel": [1.0, 0.002, 0.002, 0.003], "native": [0.001, 0.004, 0.004, 0.005]}[path]
        for seconds in layer_seconds:  # the first per path is its warm-up: the kernel's 1 s is left out
            chooser.record(decode, path, seconds)
        assert chooser.choice(decode) is None
    assert turns == ["kernel", "native"] * dispatch.TRIAL_STEPS
    assert chooser.trial_path(decode, ("kernel", "native")) == "kernel"
    choice = chooser.choice(decode)
    assert choice is not None
    assert choice.settled
    assert choice.seconds == pytest.approx({"kernel": 0.002, "native": 0.004})
    assert chooser.choice(shape()) is None  # the loop's class stays unmeasured
    chooser.record(decode, "native", 0.0)  # settled: ignored
    assert AttentionDispatch("test", LIBRARIES, tmp_path).trial_path(decode, ("kernel", "native")) == "kernel"
    stored = json.loads((tmp_path / FILE).read_text())
    assert list(stored["choices"]) == [decode.key]


def test_a_trial_within_the_noise_holds_for_the_process_only(tmp_path: Path) -> None:
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    decode = in_model()
    for _ in range(2 * dispatch.TRIAL_STEPS):
        path = chooser.trial_path(decode, ("native", "kernel"))
        for seconds in (0.01, 0.0030, 0.0030) if path == "native" else (0.01, 0.0031, 0.0031):
            chooser.record(decode, path, seconds)
    assert chooser.trial_path(decode, ("native", "kernel")) == "native"
    choice = chooser.choice(decode)
    assert choice is not None
    assert not choice.settled
    assert chooser.trial_path(decode, ("native", "kernel")) == "native"  # no second trial in this process
    assert not (tmp_path / FILE).exists()


def test_a_trial_waits_for_a_time_of_every_path_and_ignores_bad_records(tmp_path: Path) -> None:
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    decode = in_model()
    chooser.record(decode, "kernel", 0.001)  # no trial step yet: ignored
    for turn in range(2 * dispatch.TRIAL_STEPS):
        path = chooser.trial_path(decode, ("kernel", "native"))
        if turn < 2:
            chooser.record(decode, path, 0.5)  # each path's warm-up only
        chooser.record(decode, path, float("nan"))
        chooser.record(decode, path, -1.0)
    assert chooser.trial_path(decode, ("kernel", "native")) == "kernel"  # still taking turns
    assert chooser.choice(decode) is None
    chooser.record(decode, "kernel", 0.002)
    chooser.record(decode, "native", 0.001)
    assert chooser.trial_path(decode, ("kernel", "native")) == "native"
    chooser.forget()
    assert chooser.choice(decode) is None
    assert chooser.trial_path(decode, ("kernel", "native")) == "kernel"  # measured again


def test_a_shape_class_is_measured_one_of_two_ways() -> None:
    with pytest.raises(InvalidConfigError, match="'call', 'model'"):
        dataclasses.replace(shape(), measured="warm")
    assert in_model().measured == "model"


@pytest.mark.parametrize("paths", [(), ("kernel", "kernel"), ("auto",), ("gpu", "native")])
def test_trial_paths_are_checked_by_name(paths: tuple[str, ...], tmp_path: Path) -> None:
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    with pytest.raises(InvalidConfigError, match="trial paths"):
        chooser.trial_path(in_model(), paths)
    assert chooser.choices() == {}


def scripted(clock: Clock, costs: dict[str, Iterator[float]], log: list[str]) -> Callable[[str], Callable[[], str]]:
    """Paths whose calls take the next of their ``costs`` on ``clock``, logged by name."""

    def path(name: str) -> Callable[[], str]:
        def call() -> str:
            clock.now += next(costs[name])
            log.append(name)
            return name

        return call

    return path


def test_a_win_within_the_noise_holds_for_the_process_but_is_not_kept(tmp_path: Path, clock: Clock) -> None:
    costs = {  # untimed call, then the rounds: overlapping
        "kernel": iter([0.001, 0.0010, 0.0012, 0.0009, 0.0011, 0.0010, 0.001]),
        "native": iter([0.001, 0.0011, 0.0009, 0.0012, 0.0010, 0.00105, 0.001]),
    }
    log: list[str] = []
    noisy = scripted(clock, costs, log)
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    chooser.run(shape(), {"kernel": noisy("kernel"), "native": noisy("native")})
    choice = chooser.choice(shape())
    assert choice is not None
    assert not choice.settled
    assert not (tmp_path / FILE).exists()
    calls = len(log)
    chooser.run(shape(), {"kernel": noisy("kernel"), "native": noisy("native")})
    assert len(log) == calls + 1  # not measured again in this process


def test_slow_calls_are_timed_once(tmp_path: Path, clock: Clock) -> None:
    log: list[str] = []
    paths = {"kernel": clock.path(0.3, "k", log), "native": clock.path(0.2, "n", log)}
    AttentionDispatch("test", LIBRARIES, tmp_path).run(shape(), paths)
    assert log.count("k") == 2
    assert log.count("n") == 2


def test_a_slow_first_call_does_not_cut_the_rounds(tmp_path: Path, clock: Clock) -> None:
    """Compiling makes a path's first call slow: the rounds are judged by the warm calls, so
    a path whose second call is still warming up is not chosen against on one round."""
    costs = {
        "kernel": iter([1.2, 0.006, *[0.0008] * dispatch.CALIBRATION_ROUNDS]),
        "native": iter([0.002, *[0.0015] * dispatch.CALIBRATION_ROUNDS]),
    }
    log: list[str] = []
    timed = scripted(clock, costs, log)
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    assert chooser.run(shape(), {"kernel": timed("kernel"), "native": timed("native")}) == "kernel"
    assert log.count("kernel") == log.count("native") == 1 + dispatch.CALIBRATION_ROUNDS
    choice = chooser.choice(shape())
    assert choice is not None
    assert choice.path == "kernel"
    assert choice.seconds == pytest.approx({"kernel": 0.0008, "native": 0.0015})


def test_a_recorded_path_not_offered_now_is_measured_again(tmp_path: Path, clock: Clock) -> None:
    log: list[str] = []
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    chooser.run(shape(), {"kernel": clock.path(0.001, "k", log), "native": clock.path(0.002, "n", log)})
    log.clear()
    assert chooser.run(shape(), {"native": clock.path(0.002, "n", log)}) == "n"
    assert log == ["n"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"not json", "JSON"),
        (b"[]", "not an attention dispatch file"),
        (b'{"format": "kvcache-attention-dispatch", "version": 2, "machine": {}, "choices": {}}', "version 2"),
        (
            b'{"format": "kvcache-attention-dispatch", "version": 1, "machine": {"cpu": "other"}, "choices": {}}',
            "measured on",
        ),
    ],
)
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(
    tmp_path: Path, clock: Clock, content: bytes, reason: str
) -> None:
    (tmp_path / FILE).write_bytes(content)
    log: list[str] = []
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    with pytest.warns(RuntimeWarning, match=reason):
        assert chooser.run(shape(), {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)})
    assert log.count("n") > 1  # measured
    stored = json.loads((tmp_path / FILE).read_text())  # and replaced
    assert stored["machine"] == dispatch.machine_key(LIBRARIES)


def test_machines_and_versions_sharing_a_directory_keep_files_of_their_own(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home directory on a network file system serves several machines, and a new version of
    a library measures anew: neither warns nor replaces the other's choices."""
    log: list[str] = []
    paths = {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)}
    newer = {**LIBRARIES, "lib": "2"}
    AttentionDispatch("test", LIBRARIES, tmp_path).run(shape(), paths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file is foreign to its reader: none warns
        AttentionDispatch("test", newer, tmp_path).run(shape(), paths)
        monkeypatch.setattr(dispatch_files, "_cpu_model", lambda: "another CPU")
        elsewhere = dispatch.machine_key(LIBRARIES)
        AttentionDispatch("test", LIBRARIES, tmp_path).run(shape(), paths)
        monkeypatch.undo()
        keys = {FILE: dispatch.machine_key(LIBRARIES), dispatch.dispatch_file_name("test", elsewhere): elsewhere}
        keys[dispatch.dispatch_file_name("test", dispatch.machine_key(newer))] = dispatch.machine_key(newer)
        assert sorted(os.listdir(tmp_path)) == sorted(keys)
        for name, key in keys.items():
            assert json.loads((tmp_path / name).read_text())["machine"] == key
        calls = len(log)
        assert AttentionDispatch("test", LIBRARIES, tmp_path).run(shape(), paths) == "n"
        assert AttentionDispatch("test", newer, tmp_path).run(shape(), paths) == "n"
        assert len(log) == calls + 2  # each read its own file: nothing measured again


def test_the_file_name_is_the_backend_and_a_digest_of_the_machine_key() -> None:
    key = dispatch.machine_key(LIBRARIES)
    name = dispatch.dispatch_file_name("torch", key)
    assert name.startswith("dispatch-torch-")
    assert name.endswith(".json")
    assert name == dispatch.dispatch_file_name("torch", dict(reversed(list(key.items()))))  # the fields' order aside
    assert name != dispatch.dispatch_file_name("torch", {**key, "torch": "other"})
    assert name != dispatch.dispatch_file_name("jax", key)
    assert dispatch.dispatch_file_backend(name) == "torch"
    assert dispatch.dispatch_file_backend(dispatch.dispatch_file_name("my-backend", key)) == "my-backend"
    assert dispatch.dispatch_file_backend("dispatch-torch.json") == "torch"  # kvcache-core 0.3's name
    for other in ("dispatch-.json", "dispatch-torch.txt", "settings.json", "dispatch-torch", "dispatch-a b.json"):
        assert dispatch.dispatch_file_backend(other) is None, other
    with pytest.raises(InvalidTypeError, match="got bytes"):
        dispatch.dispatch_file_backend(b"dispatch-torch.json")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    for machine in ([("cpu", "x")], {"cores": 2}, {1: "x"}):
        with pytest.raises(InvalidTypeError, match="mapping of str to str"):
            dispatch.dispatch_file_name("torch", machine)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("name", ["", "../elsewhere", "a/b", ".hidden", "-flag", "x" * 65, "caf\u00e9", "a b"])
def test_a_backend_name_that_cannot_stand_in_a_file_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="backend's name"):
        AttentionDispatch(name, LIBRARIES, tmp_path)
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(name[:80]))):
        dispatch.dispatch_file_name(name, {})
    assert os.listdir(tmp_path) == []


def test_a_backend_name_that_is_not_a_str_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidTypeError, match="got bytes"):
        AttentionDispatch(b"torch", LIBRARIES, tmp_path)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def test_a_file_of_the_old_name_is_not_read(tmp_path: Path, clock: Clock) -> None:
    body = {
        "format": "kvcache-attention-dispatch",
        "version": 1,
        "machine": dispatch.machine_key(LIBRARIES),
        "choices": {shape().key: {"path": "kernel", "seconds": {"kernel": 0.001, "native": 0.002}}},
    }
    (tmp_path / "dispatch-test.json").write_text(json.dumps(body))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AttentionDispatch("test", LIBRARIES, tmp_path).choices() == {}


def test_a_bad_choice_in_a_file_of_this_machine_is_refused(tmp_path: Path) -> None:
    body: dict[str, Any] = {
        "format": "kvcache-attention-dispatch",
        "version": 1,
        "machine": dispatch.machine_key(LIBRARIES),
        "choices": {shape().key: {"path": "fastest", "seconds": {}}},
    }
    (tmp_path / FILE).write_text(json.dumps(body))
    with pytest.warns(RuntimeWarning, match="names the path 'fastest'"):
        assert AttentionDispatch("test", LIBRARIES, tmp_path).choices() == {}


def test_a_file_too_large_or_a_link_is_ignored(tmp_path: Path, clock: Clock) -> None:
    big = tmp_path / FILE
    big.write_bytes(b" " * (dispatch.MAX_FILE_BYTES + 1))
    with pytest.warns(RuntimeWarning, match="more than"):
        assert AttentionDispatch("test", LIBRARIES, tmp_path).choices() == {}
    big.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    big.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="ignoring"):
        assert AttentionDispatch("test", LIBRARIES, tmp_path).choices() == {}
    log: list[str] = []
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        AttentionDispatch("test", LIBRARIES, tmp_path).run(
            shape(), {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)}
        )
    assert target.read_text() == "{}"  # the link was replaced, not followed
    assert not big.is_symlink()


def test_forget_removes_the_choices_and_the_file(tmp_path: Path, clock: Clock) -> None:
    log: list[str] = []
    chooser = AttentionDispatch("test", LIBRARIES, tmp_path)
    chooser.run(shape(), {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)})
    chooser.forget()
    assert chooser.choices() == {}
    assert not (tmp_path / FILE).exists()


def test_the_cache_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(dispatch.CACHE_DIR_ENV, "off")
    assert dispatch.cache_directory() is None
    monkeypatch.setenv(dispatch.CACHE_DIR_ENV, str(tmp_path))
    assert dispatch.cache_directory() == tmp_path
    monkeypatch.delenv(dispatch.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dispatch.cache_directory() == tmp_path / "xdg" / "kvcache"


def test_pins_are_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidConfigError, match=r"attention_path 'fast' is unknown; valid: auto, kernel, native"):
        CacheConfig(1, 2, 8, 4, attention_path="fast")
    monkeypatch.setenv(dispatch.PATH_ENV, "fast")
    with pytest.raises(InvalidConfigError, match="KVCACHE_ATTENTION_PATH 'fast' is unknown"):
        create_manager("numpy", CacheConfig(1, 2, 8, 4))
    monkeypatch.setenv(dispatch.PATH_ENV, "native")
    assert dispatch.pinned_path("auto") == "native"
    assert dispatch.pinned_path("kernel") == "kernel"  # the config's pin wins
    assert CacheConfig(1, 2, 8, 4, attention_path="native") == CacheConfig(1, 2, 8, 4)  # not the pool's identity


def test_pinning_the_kernel_where_it_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedConfigError, match=r"the kernel reads .* this one is float64"):
        create_manager("numpy", CacheConfig(1, 2, 8, 4, dtype="float64", attention_path="kernel"))
    monkeypatch.setenv(dispatch.PATH_ENV, "kernel")  # by the environment: the kernel where it runs
    create_manager("numpy", CacheConfig(1, 2, 8, 4, dtype="float64"))
    monkeypatch.setenv(paged_kernel.DISABLE_ENV, "1")
    with pytest.raises(UnsupportedConfigError, match="numba is missing or KVCACHE_DISABLE_NUMBA is set"):
        create_manager("numpy", CacheConfig(1, 2, 8, 4, attention_path="kernel"))


def test_the_numpy_native_path_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from kvcache_core import AllocationRequest

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the kernel ran on a pool pinned to the native path")

    manager = create_manager("numpy", CacheConfig(1, 2, 8, 4, attention_path="native"))
    handle = manager.allocate(AllocationRequest(request_id="a"))
    step = manager.begin_step([handle], 5)
    step.write(0, np.ones((5, 2, 8), np.float32), np.ones((5, 2, 8), np.float32))
    monkeypatch.setattr(paged_kernel, "attend_with_kernel", refuse)
    out = manager.paged_attention(
        0, np.ones((5, 2, 8), np.float32), manager.page_table([handle]), qo_indptr=np.array([0, 5], np.int32)
    )
    np.testing.assert_allclose(out, np.ones((5, 2, 8)), rtol=1e-6)


def test_kvcache_dispatch_prints_and_forgets_the_choices(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    monkeypatch.setenv(dispatch.CACHE_DIR_ENV, str(tmp_path))
    out = io.StringIO()
    assert cli_main(["dispatch"], out) == 0
    assert "no attention dispatch file" in out.getvalue()
    log: list[str] = []
    AttentionDispatch("test", {}, tmp_path).run(
        shape(), {"kernel": clock.path(0.002, "k", log), "native": clock.path(0.001, "n", log)}
    )
    out = io.StringIO()
    assert cli_main(["dispatch"], out) == 0
    text = out.getvalue()
    assert "test:" in text
    assert "this machine" in text
    assert shape().key in text
    assert "native" in text
    (tmp_path / "dispatch-broken.json").write_text("{")
    out = io.StringIO()
    assert cli_main(["dispatch"], out) == 1
    assert "broken:" in out.getvalue()
    assert "unusable" in out.getvalue()
    out = io.StringIO()
    assert cli_main(["dispatch", "--forget"], out) == 0
    assert not list(tmp_path.glob("dispatch-*.json"))
