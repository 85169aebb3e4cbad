"""Pull throughput between two processes: ``python -m kv_transfer.bench --out results/kv_transfer.json``.

A spawned source process (`KVSource` over a SmolLM2-shaped cache with random contents) offers one
handle at a time; this process pulls it with a `KVPuller` into non-contiguous blocks. Reported per
prompt size (medians over ``repeats``, after one warm-up pull that also builds the pair):

- ``data_gbps``: bytes / `PullStats.seconds` (PULL_READY → bytes in the blocks: source gather,
  data plane, destination scatter);
- ``e2e_gbps``: bytes / wall time of the whole ``pull()`` call (adds PULL/DONE/ACK round trips);
- ``gather_s`` / ``scatter_s``: the two local copies alone, timed in this process.

Not a test; numbers depend on the machine (and on who else uses its cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.kv_cache import KVCache
from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig

SMOLLM2 = KVLayout(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)
_SECRET = b"kv-transfer-bench-secret-0123456"
_HOST = "127.0.0.1"


@dataclass(frozen=True)
class _OfferRequest:
    n_tokens: int


def _cache(layout: KVLayout, num_blocks: int, fill: bool) -> KVCache:
    shape = (num_blocks, *layout.block_shape)

    def one() -> torch.Tensor:
        t = torch.empty(shape, dtype=layout.torch_dtype)
        return t.uniform_() if fill else t.zero_()

    return KVCache(k=[one() for _ in range(layout.num_layers)], v=[one() for _ in range(layout.num_layers)],
                   block_size=layout.block_size)


def _source_main(conn: Connection, layout: KVLayout, num_blocks: int, transport: str) -> None:
    torch.set_num_threads(1)
    asyncio.run(_source(conn, layout, num_blocks, transport))


async def _source(conn: Connection, layout: KVLayout, num_blocks: int, transport: str) -> None:
    free = list(range(num_blocks))[::-1]
    outbox = Outbox(free.extend, default_lease_s=60)
    server = KVSource(_cache(layout, num_blocks, fill=True), outbox, _SECRET, layout,
                      SourceConfig(host=_HOST, transport=transport))
    await server.start()
    conn.send(server.address)
    while True:
        try:
            req = await asyncio.to_thread(conn.recv)
        except EOFError:
            break
        if not isinstance(req, _OfferRequest):
            break
        blocks = [free.pop() for _ in range(layout.blocks_for_tokens(req.n_tokens))]
        conn.send(server.offer(None, blocks, req.n_tokens))
    await server.stop()


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"bench source did not answer within {timeout_s}s")
    return conn.recv()


async def _pull_series(conn: Connection, layout: KVLayout, sizes: tuple[int, ...], repeats: int,
                       transport: str) -> tuple[float, list[dict[str, Any]]]:
    max_blocks = max(layout.blocks_for_tokens(n) for n in sizes)
    dst = _cache(layout, 2 * max_blocks, fill=False)
    # every other block: the scatter sees many runs, as a real pool's would
    dst_blocks = list(range(0, 2 * max_blocks, 2))
    puller = KVPuller(_SECRET, layout, PullerConfig(host=_HOST, transport=transport))
    results = []
    first_pull_s = 0.0
    try:
        for size in sizes:
            n_blocks = layout.blocks_for_tokens(size)
            data_s, e2e_s = [], []
            for i in range(repeats + 1):
                conn.send(_OfferRequest(size))
                handle: KVHandle = await asyncio.to_thread(_recv, conn, 60.0)
                t0 = time.perf_counter()
                stats = await puller.pull(handle, dst, dst_blocks[:n_blocks], timeout_s=60.0)
                wall = time.perf_counter() - t0
                if i == 0:  # warm-up (the very first one also builds the pair)
                    first_pull_s = first_pull_s or wall
                    continue
                data_s.append(stats.seconds)
                e2e_s.append(wall)
            nbytes = layout.nbytes_for_tokens(size)
            gather_s, scatter_s = _local_copies(dst, dst_blocks[:n_blocks], repeats)
            results.append({
                "n_tokens": size, "n_blocks": n_blocks, "bytes": nbytes,
                "data_median_s": statistics.median(data_s), "data_gbps": nbytes / statistics.median(data_s) / 1e9,
                "e2e_median_s": statistics.median(e2e_s), "e2e_gbps": nbytes / statistics.median(e2e_s) / 1e9,
                "data_min_s": min(data_s), "data_max_s": max(data_s),
                "gather_s": gather_s, "scatter_s": scatter_s,
            })
    finally:
        await puller.close()
    return first_pull_s, results


def _local_copies(cache: KVCache, blocks: list[int], repeats: int) -> tuple[float, float]:
    g, s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = cache.gather_blocks(blocks)
        t1 = time.perf_counter()
        cache.scatter_blocks(blocks, data)
        g.append(t1 - t0)
        s.append(time.perf_counter() - t1)
    return statistics.median(g), statistics.median(s)


def run_benchmark(sizes_tokens: tuple[int, ...] = (128, 1024, 4096), repeats: int = 5,
                  layout: KVLayout = SMOLLM2, transport: str = "gloo") -> dict[str, Any]:
    """Pull throughput (GB/s, medians) between this process and a spawned source; JSON-able."""
    torch.set_num_threads(1)
    sizes = tuple(sizes_tokens)
    max_blocks = max(layout.blocks_for_tokens(n) for n in sizes)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_source_main, args=(child, layout, 2 * max_blocks, transport), daemon=True)
    proc.start()
    child.close()
    try:
        _recv(conn, 120.0)  # the source's address: it is listening
        first_pull_s, results = asyncio.run(_pull_series(conn, layout, sizes, repeats, transport))
    finally:
        conn.close()
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return {
        "benchmark": "kv_transfer pull, two processes, one host",
        "transport": transport,
        "layout": layout.to_wire(),
        "bytes_per_token": layout.block_nbytes // layout.block_size,
        "repeats": repeats,
        "torch": torch.__version__,
        "torch_threads": 1,
        "cpus": mp.cpu_count(),
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0],  # other work on the same cores skews every number here
        "first_pull_s": first_pull_s,
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/kv_transfer.json"))
    ap.add_argument("--sizes", default="128,1024,4096", help="prompt sizes in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transport", default="gloo")
    args = ap.parse_args(argv)
    report = run_benchmark(tuple(int(s) for s in args.sizes.split(",")), args.repeats, transport=args.transport)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in report["results"]:
        print(f"{r['n_tokens']:>6} tokens {r['bytes'] / 1e6:8.1f} MB  data {r['data_gbps']:5.2f} GB/s  "
              f"e2e {r['e2e_gbps']:5.2f} GB/s  (gather {r['gather_s'] * 1e3:.1f} ms, "
              f"scatter {r['scatter_s'] * 1e3:.1f} ms)")
    print(f"first pull (pair setup included): {report['first_pull_s'] * 1e3:.1f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()
