"""`Engine`: one process's model, tokenizer, KV cache and block pool, loaded together.

Owns: resolving a model name to weights (bundled name, GGUF, or Hugging Face folder), building the
`ModelRunner` with a KV cache sized by `EngineConfig` (a count, or a memory budget measured on the
device once the model is built and its largest step profiled: `kv_cache_blocks`), and the block
pool over that cache. Both workers hold exactly one `Engine`.

Memory: the loaded weights are handed to the build and kept by nobody else (a backend that
reformats a class of linears frees the loaded ones as it goes), so by the time the cache is sized
and allocated nothing loaded is held twice.

Invariants: the cache and the pool agree on ``num_blocks`` and ``block_size``; ``max_model_len``
never exceeds the model's positions; loading either returns a complete engine or raises
`ModelLoadError` with nothing left allocated.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.errors import ContextLengthError
from engine.kv_budget import DEFAULT_CPU_BLOCKS, MemoryUse, available_bytes, plan_num_blocks
from engine.kv_cache import KVCache
from engine.loading.bundled import default_cache_dir
from engine.loading.file_lock import file_lock
from engine.loading.weights import ModelWeights, load_weights
from engine.memory import MemoryProbe, gib, probe_for
from engine.model.config import ModelConfig
from engine.model.model import LlamaModel, build_model
from engine.model_thread import ModelThread
from engine.runner import ModelRunner, PrefillChunk

log = logging.getLogger(__name__)

#: held while an engine on this machine builds its model (times kernels, compiles attention)
TIMING_LOCK = default_cache_dir().parent / "kernel-timing.lock"


def timing_lock(config: EngineConfig) -> AbstractContextManager[None]:
    """Engines on one CPU machine build one at a time: replicas starting together would otherwise
    time their kernel choices against each other's load and pick by chance (on GPUs: no lock)."""
    if config.torch_device.type != "cpu" or config.backend not in ("auto", "cpu"):
        return nullcontext()
    return file_lock(TIMING_LOCK)


def log_dtype(stored: torch.dtype | None, config: EngineConfig) -> None:
    """Says where the engine computes in another dtype than the checkpoint stores, and why."""
    dtype = config.torch_dtype
    if stored is None or stored == dtype:
        return
    why = ""
    if stored == torch.bfloat16 and dtype == torch.float32 and config.torch_device.type == "cpu":
        why = ": this CPU has no bf16 matmul (AVX512-BF16 / AMX), so bf16 weights compute in fp32, exactly widened"
    elif stored == torch.float16 and config.torch_device.type == "cpu":
        why = ": the CPU kernels have no fp16 path"
    log.info("weights stored in %s, computed in %s%s", str(stored).removeprefix("torch."),
             str(dtype).removeprefix("torch."), why)


def kv_cache_blocks(model: LlamaModel, mcfg: ModelConfig, config: EngineConfig, max_len: int,
                    probe: MemoryProbe) -> int:
    """The KV cache's block count: ``config.num_blocks`` as given where no budget applies (a CPU without
    ``kv_cache_memory``: `DEFAULT_CPU_BLOCKS` if unset); else `plan_num_blocks` over what ``probe`` reports
    once the model is built and its largest step (``max_step_tokens``, else ``max_len``) has run against
    a scratch cache just large enough for it."""
    budget = config.kv_budget
    if budget is None:
        return config.num_blocks or DEFAULT_CPU_BLOCKS
    weights = probe.allocated()
    peak = 0
    if probe.profiles_peak:
        n = min(config.max_step_tokens or max_len, max_len)
        blocks = -(-n // config.block_size)
        scratch = KVCache.allocate(mcfg, blocks, config.block_size, config.torch_dtype, config.device)
        chunk = PrefillChunk(token_ids=[0] * n, start_pos=0, block_table=list(range(blocks)))
        peak = probe.peak_during(lambda: ModelRunner(model, scratch).prefill([chunk]))
        del scratch
    use = MemoryUse(report=probe.report(), weights=weights, peak_step=peak)
    block_nbytes = mcfg.kv_bytes_per_token(config.torch_dtype) * config.block_size
    num_blocks = plan_num_blocks(budget, config.num_blocks, use, block_nbytes, reserved=config.reserved_memory,
                                 min_tokens=max_len, block_size=config.block_size)
    log.info("KV cache: %d blocks (%s) under kv_cache_memory=%r: %s", num_blocks, gib(num_blocks * block_nbytes),
             budget, available_bytes(budget, use, config.reserved_memory)[1])
    return num_blocks


@dataclass
class Engine:
    model_config: ModelConfig
    config: EngineConfig
    runner: ModelRunner
    pool: BlockPool
    model_dir: Path
    max_model_len: int
    # every forward of this engine runs here (one thread, one malloc arena: see `model_thread`)
    model_thread: ModelThread = field(default_factory=ModelThread, repr=False)

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def prefix_salt(self, prompt_len: int) -> int:
        """The prefix-cache salt of a prompt of ``prompt_len`` tokens (`BlockPool.match_prefix`): its
        RoPE table (`ModelConfig.rope_table_key`), on which its blocks' keys depend: 0 for every
        prompt of a fixed RoPE; longrope's short / long; dynamic NTK's length beyond
        max_position_embeddings, so only prompts of one length share blocks there."""
        return self.model_config.rope_table_key(prompt_len)

    def check_length(self, n_prompt: int, max_tokens: int = 0) -> None:
        """Refuse a prompt that cannot fit: prompt + requested tokens > max_model_len."""
        if n_prompt < 1:
            raise ValueError("the prompt is empty")
        if n_prompt + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n_prompt + max_tokens} were requested ({n_prompt} in the prompt, {max_tokens} to generate)"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig, probe: MemoryProbe | None = None) -> Engine:
        """Load ``model_dir`` and size its KV cache (``probe``: the device's memory, `probe_for` by
        default; `kv_cache_blocks`). ``engine.config.num_blocks`` is the count the cache got."""
        model_dir = Path(model_dir)
        if config.cpu_affinity:
            os.sched_setaffinity(0, set(config.cpu_affinity))
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        mcfg = ModelConfig.from_dir(model_dir)
        log_dtype(mcfg.checkpoint_dtype, config)
        return cls.from_weights(mcfg, load_weights(model_dir, mcfg, config.torch_dtype, config.torch_device,
                                                   keep_int8=config.quantization == "int8"), config, model_dir,
                                probe)

    @classmethod
    def from_weights(cls, mcfg: ModelConfig, weights: ModelWeights, config: EngineConfig,
                     model_dir: Path, probe: MemoryProbe | None = None) -> Engine:
        """An engine over weights already in memory, in ``config``'s dtype and on its device (the
        caller gives them up: the model may fold or repack them in place). ``model_dir``: the folder
        ``mcfg`` was read from (its tokenizer and grammar vocabulary are looked up there). ``probe``:
        the device's memory for sizing the KV cache (`kv_cache_blocks`; `probe_for` by default)."""
        max_len = min(config.max_model_len or mcfg.max_context, mcfg.max_context)
        config = replace(config, max_model_len=max_len)  # what the backend sizes for (before the cache is)
        with timing_lock(config):  # kernel timings and compiles, not disturbed by another engine's
            # the model takes the weights (`build_model` empties the container): a backend that reformats
            # them frees the loaded ones as it goes
            model = build_model(mcfg, weights, max_len, config)
            num_blocks = kv_cache_blocks(model, mcfg, config, max_len, probe or probe_for(config.torch_device))
            config = replace(config, num_blocks=num_blocks)
            cache = KVCache.allocate(mcfg, num_blocks, config.block_size, config.torch_dtype, config.device)
            model.attention.warm_up(model, cache)
        log.info("attention backend %s", model.attention.describe())
        pool = BlockPool(num_blocks, config.block_size, enable_prefix_cache=config.enable_prefix_cache)
        return cls(
            model_config=mcfg,
            config=config,
            runner=ModelRunner(model, cache),
            pool=pool,
            model_dir=model_dir,
            max_model_len=max_len,
        )

    def warm_up(self, num_tokens: int) -> int:
        """One throwaway prefill forward of up to ``num_tokens`` tokens; returns how many it ran.

        A replica calls this before it serves, so the allocator grows to the size of its largest
        forward at start-up (memory stays flat under load afterwards, and the first real request does
        not pay for page faults). The blocks it writes are taken from the pool and given back; the
        prefix cache never sees them.
        """
        n = min(num_tokens, self.max_model_len, self.pool.num_free_blocks * self.block_size)
        if n < 1:
            return 0
        blocks = self.pool.allocate(self.blocks_for(n))
        try:
            chunk = PrefillChunk(token_ids=[0] * n, start_pos=0, block_table=blocks)
            self.model_thread.call(self.runner.prefill, [chunk])  # on the thread that runs the load
        finally:
            self.pool.free(blocks)
        return n

    @classmethod
    def load(cls, model: str, config: EngineConfig, cache_dir: str | Path | None = None) -> Engine:
        """``model``: the bundled name, a ``.gguf`` file or a Hugging Face folder."""
        from engine.loading.bundled import prepare_model

        folder = prepare_model(model, Path(cache_dir) if cache_dir else None)
        return cls.from_dir(folder, config)
