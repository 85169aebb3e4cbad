"""`pdserve profile`: measures one replica's engine on the hardware at hand into a `ReplicaProfile`.

Owns `Sizes` (what to time) and `measure`: loads the engine directly (no Ray, no workers), then times
a prefill forward of each prompt size from an empty cache and a decode step of each batch and
per-sequence context, the median of ``repeats`` runs after one warm-up, with a progress bar on
stderr. The engine's own forwards are timed (`engine.runner.ModelRunner.prefill` / ``decode``), on
the device's clock where it has one (CUDA is synchronized before each reading).

Invariants: the profile says ``source: measured`` and names the model and device; the KV transfer
speed is not measured here (a pair of pools is needed for that) and is the one given, which the
profile's notes say. Blocks are taken from the engine's pool for each timing and given back.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.planner.profile import DecodePoint, PrefillPoint, ReplicaProfile
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_budget import DEFAULT_CPU_BLOCKS
from engine.runner import DecodeSeq, PrefillChunk


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, ...] = (16, 64, 256, 512)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 3

    def __post_init__(self) -> None:
        if len(self.prefill) < 2 or len(self.batches) * len(self.contexts) < 3 or self.repeats < 1:
            raise ValueError("need >= 2 prefill sizes, >= 3 decode points and >= 1 repeat")
        if min(*self.prefill, *self.batches, *self.contexts) < 1:
            raise ValueError("sizes must be >= 1")


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    """``n`` token ids spread over the first thousand of the vocabulary (past the usual special ids
    0-2), the same for every run, so timings of one length compare across runs and tools."""
    return [3 + (i * 7919) % (min(vocab, 1000) - 3) for i in range(n)]


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def median(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return median


def _blocks_needed(sizes: Sizes, block_size: int) -> int:
    """Blocks for the largest timing: the longest prompt, or the largest batch at the longest context."""
    def blocks(n: int) -> int:
        return -(-n // block_size)

    return max(blocks(max(sizes.prefill)), max(sizes.batches) * blocks(max(sizes.contexts) + 1)) + 1


def measure(model: str, config: EngineConfig, sizes: Sizes, *, cache_dir: str | None = None,
            transfer_bytes_per_s: float = 1e9, gpus_per_replica: int = 1, kv_blocks: int | None = None,
            progress: bool = True) -> ReplicaProfile:
    """Time ``model`` under ``config`` at ``sizes``. ``kv_blocks``: the decode replica's KV blocks to
    record (None: what ``config`` gives a replica; on a CPU the timings get a pool of their own size)."""
    configured = config.num_blocks
    if config.device == "cpu":  # room for the largest batch (a GPU's pool is sized by its budget)
        configured = configured or DEFAULT_CPU_BLOCKS  # what a replica of this config would hold
        need = _blocks_needed(sizes, config.block_size)
        config = dataclasses.replace(config, num_blocks=max(need, config.num_blocks or 0),
                                     max_num_seqs=max(config.max_num_seqs, max(sizes.batches)))
    eng = Engine.load(model, config, cache_dir)
    timed = _timer(config.device)
    vocab = eng.model_config.vocab_size
    points = [("prefill", n, 0) for n in sizes.prefill] + [
        ("decode", b, c) for b in sizes.batches for c in sizes.contexts]
    bar = _bar(len(points), progress)
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    for kind, a, c in points:
        if kind == "prefill":
            ids = synthetic_prompt(a, vocab)
            blocks = eng.pool.allocate(eng.blocks_for(a))
            try:
                chunk = [PrefillChunk(ids, 0, blocks)]
                prefill.append(PrefillPoint(a, timed(functools.partial(eng.runner.prefill, chunk), sizes.repeats)))
            finally:
                eng.pool.free(blocks)
        else:
            tables = [eng.pool.allocate(eng.blocks_for(c + 1)) for _ in range(a)]
            seqs = [DecodeSeq((100 + i) % vocab, c, t) for i, t in enumerate(tables)]
            try:
                decode.append(DecodePoint(a, c, timed(functools.partial(eng.runner.decode, seqs), sizes.repeats)))
            finally:
                for t in tables:
                    eng.pool.free(t)
        bar(f"{kind} {a}" + (f"x{c}" if kind == "decode" else ""))
    device = torch.cuda.get_device_name() if config.device.startswith("cuda") else (
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads")
    return ReplicaProfile(
        label=f"{eng.model_dir.name} on {device} (measured)", source="measured", hardware=device, model=model,
        gpus_per_replica=gpus_per_replica, block_size=eng.block_size,
        kv_blocks=kv_blocks or configured or eng.pool.num_blocks, max_num_seqs=config.max_num_seqs,
        kv_bytes_per_token=eng.model_config.kv_bytes_per_token(config.torch_dtype),
        transfer_bytes_per_s=transfer_bytes_per_s, prefill=tuple(prefill), decode=tuple(decode),
        notes=f"measured by pdserve profile, dtype {config.dtype}; transfer_bytes_per_s given, not measured")


def _bar(total: int, enabled: bool) -> Callable[[str], None]:
    from tqdm import tqdm

    bar = tqdm(total=total, disable=not enabled, unit="point")

    def step(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)
        if bar.n >= total:
            bar.close()

    return step


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"16,64,256"`` → (16, 64, 256); a bad list is refused, naming it."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return out
