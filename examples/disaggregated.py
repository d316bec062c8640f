"""Disaggregated prefill and decode with transformers: one process prefills a prompt, another
decodes it, and the prompt's K/V travel between their pools over NIXL instead of being
recomputed (``pip install "kvcache-core[transfer]" "kvcache-torch[hf]"``).

The prefill worker (a process of its own) runs ``generate`` for one token with a
``PagedCache``, exports the request (``KvTransferAgent.export``: its blocks stay pinned under a
lease) and sends the ticket and the first token; the decode worker (this process) imports the
request into its own pool (one NIXL READ of every layer) and hands it to a ``PagedCache``
(``handles=``): ``generate`` then computes one token per step, never the prompt. Both load the
same checkpoint (a tiny random Llama saved to a temporary folder; ``--family bamba``: a tiny
hybrid of Mamba2 state layers and attention, whose recurrent states travel in the same read).

Run: python examples/disaggregated.py [--family llama|bamba] [--save results.npz]
(``--save``: the decode worker's tokens and logits, and the tokens each of its forwards
computed; tests/transfer/test_hf_handoff.py compares them with a single-process run.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import sys
import tempfile
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is local: nothing reaches the network

PROMPT_LENGTH = 45  # 5 full blocks of 8 and 5 tokens
NEW_TOKENS = 16
BLOCK_SIZE = 8
PROMPT = [(7 * position + 3) % 97 + 3 for position in range(PROMPT_LENGTH)]
#: The model families the example builds: a Llama, and Bamba (Mamba2 layers 0 and 2, attention 1 and 3).
FAMILIES = ("llama", "bamba")
_SHARED: dict[str, Any] = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,  # never stop early
}
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_hidden_layers": 2, "max_position_embeddings": 256}),
    "bamba": (
        "BambaConfig",
        # Mamba2 mixers of 8 heads of 16 (twice the width), states of 8, chunks of 16 tokens.
        {
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "mamba_n_heads": 8,
            "mamba_d_state": 8,
            "mamba_chunk_size": 16,
        },
    ),
}


def missing() -> str | None:
    """Why the example cannot run here (torch, transformers or NIXL missing), or ``None``."""
    try:
        import torch  # noqa: F401  # pyright: ignore[reportUnusedImport]
        import transformers  # noqa: F401  # pyright: ignore[reportUnusedImport]

        from kvcache_core.transfer import nixl_unavailable_reason
    except ImportError as exc:
        return str(exc)
    return nixl_unavailable_reason()


def quiet() -> None:
    """No progress bars from transformers (saving and loading a checkpoint)."""
    import transformers

    logging: Any = transformers.utils.logging
    logging.disable_progress_bar()


def save_tiny_model(folder: str, family: str = "llama") -> None:
    """A tiny model of ``family`` (:data:`FAMILIES`) with random weights (seeded), saved as a
    checkpoint both workers load."""
    import torch
    import transformers

    quiet()
    torch.random.manual_seed(0)  # pyright: ignore[reportUnknownMemberType]  # seed untyped in torch
    name, fields = _CONFIGS[family]
    config: Any = getattr(transformers, name)(**_SHARED, **fields)
    model_class: Any = getattr(transformers, name.replace("Config", "ForCausalLM"))
    model: Any = model_class(config)
    model.save_pretrained(folder)


def load_worker(folder: str) -> tuple[Any, Any]:
    """A worker's model (``"kvcache_paged"`` attention) and its pool (torch, prefix caching;
    a state slot per request for a model with state layers)."""
    import transformers

    quiet()
    import kvcache_torch.hf  # noqa: F401  # pyright: ignore[reportUnusedImport]  # registers "kvcache_paged"
    from kvcache_core import create_manager
    from kvcache_torch.hf import cache_config_for

    auto: Any = transformers.AutoModelForCausalLM
    model: Any = auto.from_pretrained(folder, attn_implementation="kvcache_paged")
    model.eval()
    slots = 4 if model.config.model_type == "bamba" else None  # state slots: for state layers only
    config = cache_config_for(model, num_blocks=64, block_size=BLOCK_SIZE, state_slots=slots)
    # The namespace names the checkpoint: both pools must agree on it.
    namespace = f"tiny-{model.config.model_type}@example"
    config = dataclasses.replace(config, enable_prefix_caching=True, model_id=namespace)
    return model, create_manager("torch", config)


def generate_settings(new_tokens: int) -> dict[str, Any]:
    """Greedy decoding of ``new_tokens``, returning every step's logits."""
    return {
        "max_new_tokens": new_tokens,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }


def prefill_worker(folder: str, connection: Connection) -> None:
    """Prefill the prompt it is sent, export the request, send ``(ticket, tokens, logits)``;
    stay up (the lease pins the blocks) until the decode worker says it is done."""
    import torch

    from kvcache_core.transfer import KvTransferAgent
    from kvcache_torch.hf import PagedCache

    model, manager = load_worker(folder)
    with manager, KvTransferAgent(manager) as agent:
        prompt = torch.tensor([connection.recv()])
        cache = PagedCache(manager, model)
        with torch.no_grad():
            out = model.generate(prompt, cache=cache, **generate_settings(1))  # the prompt's K/V and the first token
        cache.flush_states()  # a hybrid model's last states into the request's slot, for the export
        ticket = agent.export(cache.handles[0])  # pinned under a lease (states too): the cache may let go now
        cache.release()
        connection.send((ticket.to_bytes(), out.sequences[0].tolist(), out.logits[0].numpy()))
        connection.recv()  # "done": the decode worker imported the request (it released the lease)


def decode_worker(folder: str, ticket: bytes, sequence: list[int]) -> dict[str, Any]:
    """Import the request, go on generating from it; the tokens, logits and the new tokens
    each forward computed."""
    import numpy as np
    import torch

    from kvcache_core import AllocationRequest
    from kvcache_core.transfer import KvTransferAgent
    from kvcache_torch.hf import PagedCache

    model, manager = load_worker(folder)
    computed: list[int] = []

    def count(_module: Any, inputs: tuple[Any, ...], _output: Any) -> None:  # the tokens a forward embeds
        computed.append(int(inputs[0].shape[1]))

    model.model.embed_tokens.register_forward_hook(count)
    with manager, KvTransferAgent(manager) as agent:
        handle = agent.import_request(ticket, AllocationRequest("decode-0"))
        imported = handle.num_tokens()
        with PagedCache(manager, model, handles=[handle]) as cache, torch.no_grad():
            # The cache holds the prompt: generate computes the first token onward, one per step.
            out = model.generate(torch.tensor([sequence]), cache=cache, **generate_settings(NEW_TOKENS - 1))
        return {
            "tokens": out.sequences[0].numpy(),
            "logits": np.stack([logits[0].numpy() for logits in out.logits]),
            "computed": np.asarray(computed),
            "imported": imported,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Disaggregated prefill and decode with transformers over NIXL.")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="the tiny model's family (llama)")
    parser.add_argument("--save", help="write the decode worker's results to this .npz file")
    args = parser.parse_args(argv)
    reason = missing()
    if reason is not None:
        print(f"skipped: this example needs torch, transformers and NIXL: {reason}")
        return 0
    import numpy as np

    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_model(folder, args.family)
        ours, theirs = spawn.Pipe()
        prefill = spawn.Process(target=prefill_worker, args=(folder, theirs), daemon=True)
        prefill.start()
        theirs.close()  # the worker's end lives in the worker only: its exit ends the pipe
        try:
            ours.send(PROMPT)
            if not ours.poll(300):
                raise RuntimeError("the prefill worker sent nothing in 300 s")
            ticket, sequence, first_logits = ours.recv()
            result = decode_worker(folder, ticket, sequence)
        finally:
            with contextlib.suppress(OSError):  # the prefill worker may be gone already
                ours.send("done")
            prefill.join(timeout=60)
            if prefill.is_alive():
                prefill.kill()
    result["logits"] = np.concatenate([first_logits, result["logits"]])  # the prefill worker's first step
    print(f"prefill worker: {PROMPT_LENGTH} prompt tokens; decode worker imported {result['imported']} tokens")
    print(f"decode worker computed {result['computed'].tolist()} tokens per forward (0 prompt tokens)")
    print("generated:", result["tokens"][PROMPT_LENGTH:].tolist())
    if args.save:
        np.savez(args.save, **result)
    return prefill.exitcode or 0


if __name__ == "__main__":
    sys.exit(main())
