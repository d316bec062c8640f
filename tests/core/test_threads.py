"""One manager shared by several threads: no block owned twice, none leaked, data intact."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from kvcache_core import AllocationRequest, CacheConfig, OutOfBlocksError, create_manager


def test_threads_allocating_writing_reading_and_freeing_keep_the_pool_consistent() -> None:
    config = CacheConfig(num_layers=2, num_heads=2, head_dim=4, num_blocks=96, block_size=4)
    manager = create_manager("numpy", config)
    failures: list[str] = []
    barrier = threading.Barrier(6)

    def worker(worker_id: int) -> None:
        rng = np.random.default_rng(worker_id)
        barrier.wait()
        for round_index in range(40):
            request_id = f"w{worker_id}-{round_index}"
            try:
                handle = manager.allocate(AllocationRequest(request_id, max_sequence_length=40))
            except OutOfBlocksError:
                continue
            written: list[npt.NDArray[np.float32]] = []
            try:
                for _ in range(int(rng.integers(1, 6))):
                    count = int(rng.integers(1, 8))
                    slots = manager.extend(handle, count)
                    keys = rng.standard_normal((count, 2, 4)).astype(np.float32)
                    for layer in range(2):
                        manager.write(layer, slots, keys + layer, -keys)
                    written.append(keys)
            except OutOfBlocksError:
                pass
            expected = np.concatenate(written) if written else np.zeros((0, 2, 4), np.float32)
            expected = expected[: handle.num_tokens()]
            for layer in range(2):
                keys_back, values_back = manager.gather(handle, layer)
                if not (np.array_equal(keys_back, expected + layer) and np.array_equal(values_back, -expected)):
                    failures.append(f"{request_id} layer {layer}: data changed under another thread")
            manager.deallocate(request_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    manager.check_invariants()
    stats = manager.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.active_caches) == (0, 96, 0)
    assert stats.allocation_count > 0
