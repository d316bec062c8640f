"""The command line every benchmark shares: ``--quick`` (a smoke run with smaller defaults),
the geometry, the requests' lengths, the timing and the threads, each flag written once."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvcache_core.plugin import KV_LAYOUTS

from .geometry import Geometry

__all__ = ["BenchParser", "geometry_of", "int_list", "layout_list", "positive_int", "seed_list"]

#: A flag's default: one value, or ``(full, quick)`` where ``--quick`` uses a smaller one.
Default = object


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _at_least(text, 1)


def _at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def int_list(text: str, minimum: int = 1) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]`` (an argparse type; each value >= ``minimum``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def layout_list(text: str) -> list[str]:
    """``"heads_first,NHD"`` -> ``["heads_first", "NHD"]`` (an argparse type; each a pool layout)."""
    layouts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [layout for layout in layouts if layout not in KV_LAYOUTS]
    if not layouts or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated layouts of {', '.join(KV_LAYOUTS)}, got {text!r}")
    return layouts


def seed_list(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (an argparse type)."""
    return int_list(text, minimum=0)


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in cast("Sequence[object]", value))
    return str(value)


class BenchParser(argparse.ArgumentParser):
    """A benchmark's command line: ``--quick`` and the shared flags, whose defaults may differ
    in a quick run (given as ``(full, quick)``); ``parse`` applies them and checks the
    relations between flags (query heads a multiple of KV heads, shortest <= longest)."""

    def __init__(self, description: str | None, *, quick: str) -> None:
        super().__init__(description=description.split("\n\n")[0] if description else None)
        self._quick_defaults: dict[str, tuple[object, object]] = {}
        self._checks: list[tuple[Callable[[argparse.Namespace], bool], str]] = []
        self.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")

    def flag(
        self, name: str, default: Default, *, type: Callable[[str], Any] = positive_int, help: str, **options: Any
    ) -> None:
        """``--name`` of ``type`` (an integer >= 1 unless said), ``default`` or ``(full, quick)``;
        ``help`` is prose (a ``%`` in it is printed as it is, not read as argparse's formatting)."""
        help = help.replace("%", "%%")
        if isinstance(default, tuple):
            full, quick = cast("tuple[object, object]", default)
            self._quick_defaults[name.lstrip("-").replace("-", "_")] = (full, quick)
            shown = f"default {_shown(full)}; quick {_shown(quick)}"
            self.add_argument(name, type=type, default=None, help=f"{help} ({shown})", **options)
        else:
            self.add_argument(name, type=type, default=default, help=f"{help} (default {_shown(default)})", **options)

    def require(self, condition: Callable[[argparse.Namespace], bool], message: str) -> None:
        """Refuse the command line (``message``) unless ``condition(args)`` after the defaults."""
        self._checks.append((condition, message))

    def geometry(
        self,
        *,
        layers: Default = None,
        query_heads: Default = None,
        kv_heads: Default = None,
        head_dim: Default = None,
        block_size: Default = None,
        kv_layout: str | None = None,
        hidden: Default = None,
    ) -> None:
        """The geometry flags this benchmark takes (``None``: not a flag of it)."""
        for name, default, meaning in (
            ("--layers", layers, "layers"),
            ("--hidden", hidden, "hidden size"),
            ("--query-heads", query_heads, "query heads"),
            ("--kv-heads", kv_heads, "KV heads"),
            ("--head-dim", head_dim, "features per head"),
            ("--block-size", block_size, "tokens per block of our pool"),
        ):
            if default is not None:
                self.flag(name, default, help=meaning)
        if kv_layout is not None:
            self.add_argument(
                "--kv-layout", choices=KV_LAYOUTS, default=kv_layout, help=f"layout of our pool (default {kv_layout})"
            )
        if query_heads is not None and kv_heads is not None:
            self.require(
                lambda args: args.query_heads % args.kv_heads == 0, "--query-heads must be a multiple of --kv-heads"
            )
        if hidden is not None and query_heads is not None:
            self.require(
                lambda args: args.hidden % args.query_heads == 0, "--hidden must be a multiple of --query-heads"
            )

    def lengths(
        self, *, count: Default, min_length: Default, max_length: Default, count_flag: str = "--batch-size"
    ) -> None:
        """Requests of lengths drawn uniformly between ``--min-length`` and ``--max-length``."""
        self.flag(count_flag, count, help="requests")
        self.flag("--min-length", min_length, help="shortest request")
        self.flag("--max-length", max_length, help="longest request")
        self.require(lambda args: args.min_length <= args.max_length, "--min-length must be <= --max-length")

    def seed(self, *, what: str = "lengths and data") -> None:
        """``--seed`` (0 by default)."""
        self.flag("--seed", 0, type=lambda text: _at_least(text, 0), help=f"seed of {what}")

    def timing(self, repeats: Default, *, what: str = "timed steps per competitor") -> None:
        """``--repeats`` and ``--statistic`` (median or min)."""
        self.flag("--repeats", repeats, help=what)
        self.add_argument(
            "--statistic",
            choices=("median", "min"),
            default="median",
            help="figure of the timed samples: median (default) or min (steadier on a shared machine)",
        )

    def threads(self) -> None:
        """``--threads``: torch's intra-op threads (torch's choice, all cores, by default)."""
        self.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parse ``argv``, apply the quick or full defaults, run the checks."""
        args = self.parse_args(argv)
        for name, (full, quick) in self._quick_defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, quick if args.quick else full)
        for condition, message in self._checks:
            if not condition(args):
                self.error(message)
        return args


def geometry_of(args: argparse.Namespace, **fields: Any) -> Geometry:
    """The ``Geometry`` the geometry flags give (``fields`` for what is not a flag here)."""
    given = {
        "num_layers": getattr(args, "layers", None),
        "num_query_heads": getattr(args, "query_heads", None),
        "num_kv_heads": getattr(args, "kv_heads", None),
        "head_dim": getattr(args, "head_dim", None),
        "block_size": getattr(args, "block_size", None),
        "kv_layout": getattr(args, "kv_layout", None),
        "placement": getattr(args, "placement", None),
    }
    return Geometry(**{**{key: value for key, value in given.items() if value is not None}, **fields})
