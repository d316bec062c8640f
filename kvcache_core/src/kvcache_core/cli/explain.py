"""``kvcache explain``: where a prompt's prefix is in a fleet's shared Redis store, and why its
chain stops (:mod:`kvcache_core.offload.explain`).

::

    kvcache explain prompt.json --redis redis://cache:6379/0 --model-id llama-3-8b \\
        --num-layers 32 --num-heads 8 --head-dim 128 --dtype bfloat16 --block-size 16

The prompt file holds token ids: a JSON list, or integers separated by spaces, commas or
new lines (``-`` reads standard input). The pool's geometry must be the fleet's: records of
another geometry or block size are another family of keys (the explanation says when the
store holds those).
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol, TextIO, cast

from kvcache_core.contract.config import CacheConfig
from kvcache_core.errors import InvalidArgumentError
from kvcache_core.offload.events import EventHub
from kvcache_core.offload.explain import explain_prefix
from kvcache_core.offload.redis_tier import RedisTier
from kvcache_core.offload.strict_json import parse_json
from kvcache_core.offload.tier_stack import TierChain

__all__ = ["add_explain_parser", "read_prompt", "run_explain"]


class _Commands(Protocol):
    """The ``kvcache`` parser's subcommands (argparse's private ``_SubParsersAction``)."""

    def add_parser(self, name: str, **options: Any) -> argparse.ArgumentParser: ...


#: The largest prompt file read.
MAX_PROMPT_BYTES = 64 << 20


def add_explain_parser(commands: _Commands) -> None:
    """Add the ``explain`` subcommand to the ``kvcache`` parser."""
    parser = commands.add_parser(
        "explain", help="say where a prompt's prefix is in a fleet's Redis store and why it stops"
    )
    parser.add_argument("prompt", help="file of token ids (a JSON list, or integers separated by spaces); - for stdin")
    parser.add_argument(
        "--redis", required=True, metavar="URL", help="the store (redis://host:port/db, rediss:// for TLS)"
    )
    parser.add_argument("--prefix", default="kvcache", help="the fleet's key prefix (default: kvcache)")
    parser.add_argument("--model-id", default=None, help="the namespace (the pools' model_id; default: none)")
    parser.add_argument("--salt", default=None, help="the requests' cache salt (default: none)")
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--num-heads", type=int, required=True, help="KV heads per layer")
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    parser.add_argument("--dtype", default="float16", help="the pools' dtype (default: float16)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds the store may take to answer (default: 5)")


def read_prompt(source: str) -> list[int]:
    """The token ids of the prompt file ``source`` (``-``: standard input).

    Raises:
        InvalidArgumentError: the file cannot be read, is larger than :data:`MAX_PROMPT_BYTES`,
            or does not hold token ids.
    """
    try:
        if source == "-":
            text = sys.stdin.read(MAX_PROMPT_BYTES + 1)
        else:
            with Path(source).open(encoding="utf-8") as file:
                text = file.read(MAX_PROMPT_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"cannot read the prompt file {source!r}: {exc}") from exc
    if len(text) > MAX_PROMPT_BYTES:
        raise InvalidArgumentError(f"the prompt file {source!r} is longer than {MAX_PROMPT_BYTES} characters")
    stripped = text.strip()
    if stripped.startswith("["):
        listed = parse_json(stripped, what=f"the prompt file {source!r}", error=InvalidArgumentError)
        items = cast("list[object]", listed) if isinstance(listed, list) else None
        if items is None or not all(type(token) is int for token in items):
            raise InvalidArgumentError(f"the prompt file {source!r} must hold a JSON list of integers")
        return cast("list[int]", items)
    words = [word for word in re.split(r"[\s,]+", stripped) if word]
    if not all(re.fullmatch(r"\d+", word) for word in words):
        bad = next(word for word in words if not re.fullmatch(r"\d+", word))
        raise InvalidArgumentError(f"the prompt file {source!r} holds {bad[:40]!r}; token ids are integers >= 0")
    return [int(word) for word in words]


def run_explain(args: argparse.Namespace, out: TextIO) -> int:
    """Print where the prompt's prefix is in the store; 0, or 1 when the store failed to answer.

    Raises:
        KvCacheError: a bad option or prompt file (the message names it).
    """
    config = CacheConfig(
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_dim=args.head_dim,
        num_blocks=1,
        block_size=args.block_size,
        dtype=args.dtype,
        enable_prefix_caching=True,
        model_id=args.model_id,
    )
    prompt = read_prompt(args.prompt)
    tier = RedisTier(
        args.redis, config.bytes_per_block, prefix=args.prefix, deadline_s=args.timeout, retry_after_s=args.timeout
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = TierChain([tier], config, EventHub(config.block_size))
        try:
            explanation = explain_prefix(config, prompt, args.salt, pool=None, tiers=chain)
        finally:
            chain.close()
            tier.close()
    out.write(f"{explanation}\n")
    failures = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
    for failure in failures:
        out.write(f"warning: {failure}\n")
    return 1 if failures else 0
