"""The ``kvcache`` command: ``kvcache backends``, ``kvcache demo``, ``kvcache check`` and ``kvcache explain``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

from kvcache_core import __version__
from kvcache_core._table import write_table
from kvcache_core.cli.demo import DemoOptions, run_demo
from kvcache_core.cli.dispatch import run_dispatch
from kvcache_core.cli.explain import add_explain_parser, run_explain
from kvcache_core.discovery import KNOWN_BACKENDS, installed_backends
from kvcache_core.errors import KvCacheError

__all__ = ["main"]


def _backends(out: TextIO) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = installed_backends()
    rows: list[list[str]] = []
    for info in infos:
        available, reason = info.spec.availability()
        rows.append(
            [
                info.name,
                info.distribution,
                info.version,
                "yes" if available else f"no: {reason}",
                ", ".join(info.spec.devices),
                info.spec.description or "-",
            ]
        )
    write_table(["name", "distribution", "version", "available", "devices", "description"], rows, out)
    missing = [name for name in KNOWN_BACKENDS if name not in {info.name for info in infos}]
    if missing:
        out.write("\nnot installed: " + ", ".join(f"{name} ({KNOWN_BACKENDS[name]})" for name in missing) + "\n")
    for warning in caught:
        out.write(f"\nwarning: {warning.message}\n")
    return 0


def _demo(args: argparse.Namespace, out: TextIO) -> int:
    options = DemoOptions(num_requests=args.requests, seed=args.seed)
    report = run_demo(args.backend, options, out)
    return 0 if report.ok else 1


def _check(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from kvcache_core.testing.check import run_check
    except ImportError as exc:
        sys.stderr.write(
            f"kvcache: error: the conformance kit needs pytest and hypothesis ({exc}); install them with: "
            "pip install 'kvcache-core[testing]'\n"
        )
        return 2
    result = run_check(
        args.backend,
        max_examples=args.max_examples,
        steps=args.steps,
        seed=args.seed,
        require_all=args.require_all,
        verbose=args.verbose,
        out=out,
    )
    return 0 if result.ok else 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache", description="Paged key/value cache for transformer inference.")
    parser.add_argument("--version", action="version", version=f"kvcache-core {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("backends", help="list installed backends and whether they can run here")
    demo = commands.add_parser("demo", help="serve a small random transformer through the paged cache and check it")
    demo.add_argument("--backend", default="numpy", help="backend to run on (default: numpy)")
    demo.add_argument("--requests", type=_positive, default=DemoOptions.num_requests, help="requests to serve")
    demo.add_argument(
        "--seed", type=_non_negative, default=DemoOptions.seed, help="seed of weights and workload (>= 0)"
    )
    check = commands.add_parser("check", help="run the conformance kit against installed backends")
    check.add_argument(
        "--backend", action="append", default=[], metavar="NAME", help="check this backend (repeatable; default: all)"
    )
    check.add_argument("--max-examples", type=_positive, default=None, help="Hypothesis examples per property test")
    check.add_argument("--steps", type=_positive, default=None, help="steps per state-machine run")
    check.add_argument(
        "--seed", type=_non_negative, default=None, help="seed of the kit's property tests (default 0, printed)"
    )
    check.add_argument(
        "--require-all",
        action="store_true",
        help="fail, instead of skipping, the tests of policies a backend does not claim",
    )
    check.add_argument("-v", "--verbose", action="store_true", help="show every test, not only failures")
    add_explain_parser(commands)
    dispatch = commands.add_parser(
        "dispatch", help="show the attention path each shape class runs on this machine (measured, kept on disk)"
    )
    dispatch.add_argument("--forget", action="store_true", help="remove the choices: the next run measures again")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit status."""
    stream = out or sys.stdout
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "backends":
            return _backends(stream)
        if args.command == "check":
            return _check(args, stream)
        if args.command == "explain":
            return run_explain(args, stream)
        if args.command == "dispatch":
            return run_dispatch(args, stream)
        return _demo(args, stream)
    except KvCacheError as exc:
        sys.stderr.write(f"kvcache: error: {exc}\n")
        return 2
