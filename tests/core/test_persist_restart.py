"""Restart: a process saves its prefix cache, a new process on another backend loads it and
computes only the uncached tokens, with the original process's attention outputs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.process_support import run_python

pytest.importorskip("safetensors")

#: One process's life: build a manager, load a saved cache (if any), serve one request whose
#: prompt shares the cached prefix, record its attention output, save the cache.
WORKER = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    from kvcache_core import AllocationRequest, CacheConfig, create_manager

    backend, load_from, save_to, output = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    LAYERS, HEADS, DIM, BLOCK = 2, 2, 8, 8
    config = CacheConfig(num_layers=LAYERS, num_heads=HEADS, head_dim=DIM, num_blocks=32, block_size=BLOCK,
                         enable_prefix_caching=True, model_id="tiny-model@r1")
    manager = create_manager(backend, config)
    storage = manager.storage

    def kv(tokens, position, layer):
        seed = hashlib.sha256(repr((tuple(tokens[: position + 1]), layer)).encode()).digest()
        pair = np.random.default_rng(int.from_bytes(seed[:8], "little")).standard_normal((2, HEADS, DIM))
        return pair.astype(np.float32)

    if load_from != "-":
        print("loaded", manager.load_prefix_cache(load_from))
    prompt = list(range(1000, 1040)) + [7, 7, 7, 7, 7]  # 5 shared blocks, then 5 tokens of its own
    if load_from == "-":  # the first process computes the shared prompt once
        first = manager.allocate(AllocationRequest("first", initial_tokens=40, prompt_token_ids=tuple(prompt[:40])))
        slots = manager.extend(first, 40)
        for layer in range(LAYERS):
            pairs = np.stack([kv(prompt, p, layer) for p in range(40)])
            manager.write(layer, slots, storage.from_numpy(pairs[:, 0]), storage.from_numpy(pairs[:, 1]))
        manager.deallocate("first")
    handle = manager.allocate(AllocationRequest("r", initial_tokens=len(prompt), prompt_token_ids=tuple(prompt)))
    start = handle.num_tokens()
    print("computed", len(prompt) - start)
    slots = manager.extend(handle, len(prompt) - start)
    for layer in range(LAYERS):
        pairs = np.stack([kv(prompt, p, layer) for p in range(start, len(prompt))])
        manager.write(layer, slots, storage.from_numpy(pairs[:, 0]), storage.from_numpy(pairs[:, 1]))
    query = np.random.default_rng(0).standard_normal((1, 2 * HEADS, DIM)).astype(np.float32)
    table = manager.page_table([handle])
    outs = [storage.to_numpy(manager.paged_attention(layer, storage.from_numpy(query), table)) for layer in range(LAYERS)]
    np.save(output, np.stack(outs).astype(np.float32))
    manager.deallocate("r")
    print("saved", manager.save_prefix_cache(save_to))
    """
)


def run(tmp_path: Path, backend: str, load_from: str, save_to: str, output: str) -> str:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = run_python(str(script), backend, load_from, save_to, output, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_prefix_cache_survives_restarts_across_numpy_torch_and_jax(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    first = run(tmp_path, "numpy", "-", str(tmp_path / "a.safetensors"), str(tmp_path / "numpy.npy"))
    assert "computed 5" in first  # its own request hit the prompt it computed
    second = run(
        tmp_path, "torch", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), str(tmp_path / "torch.npy")
    )
    assert "loaded 5" in second
    assert "computed 5" in second  # only the tokens after the cached 40
    third = run(
        tmp_path, "jax", str(tmp_path / "b.safetensors"), str(tmp_path / "c.safetensors"), str(tmp_path / "jax.npy")
    )
    assert "loaded 5" in third  # what the torch process saved: the same chain, read from its pool
    assert "computed 5" in third
    reference = np.load(tmp_path / "numpy.npy")
    for backend in ("torch", "jax"):
        np.testing.assert_allclose(np.load(tmp_path / f"{backend}.npy"), reference, rtol=1e-5, atol=1e-5)
