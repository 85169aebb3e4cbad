"""Sizing the paged KV cache from a memory budget: `MemoryUse` and `plan_num_blocks`.

The budget is ``EngineConfig.kv_cache_memory`` (`EngineConfig.kv_budget` resolves its default):

- bytes (an int): the KV cache's own size: ``bytes // block_nbytes`` blocks;
- a fraction ``f`` in (0, 1] (a float): of the device's *total* memory, the share this engine may
  use in all, as vLLM's ``gpu_memory_utilization``: the KV cache gets
  ``f × total − weights − peak step − reserved``, so two engines on one device can each be given 0.45;
- None: `DEFAULT_DEVICE_FRACTION` on CUDA; on a CPU no budget at all (``num_blocks`` as given, else
  `DEFAULT_CPU_BLOCKS`), as before budgets existed.

Whatever the budget says, the cache must also fit what is free now, less the peak step (free again
after the profile, but every step will need it) and ``reserved`` (bytes held back for KV transfers in
flight): ``cache <= free − peak step − reserved``.

``num_blocks`` given with a budget is checked against it, never silently cut; given none, it is
derived, and must hold one sequence of ``max_model_len`` tokens. Every refusal is a
`MemoryBudgetError` whose message names the number that does not fit and the figures behind it.

Invariants: pure arithmetic over `MemoryUse` (no device is asked here); the result is >= 1 block.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import MemoryBudgetError
from engine.memory import MemoryReport, gib

#: ``kv_cache_memory`` left unset on CUDA: the engine's share of the device's total memory.
DEFAULT_DEVICE_FRACTION = 0.9
#: a CPU engine given neither ``num_blocks`` nor ``kv_cache_memory`` gets this many blocks.
DEFAULT_CPU_BLOCKS = 1024
#: an int ``kv_cache_memory`` below this is refused: it reads as a fraction written without a point.
MIN_BUDGET_BYTES = 1 << 20

Budget = int | float  # bytes, or a fraction of the device's total memory


@dataclass(frozen=True)
class MemoryUse:
    """What an engine measured before sizing its cache (bytes)."""

    report: MemoryReport  # the device once the model is built and its peak step profiled
    weights: int  # what this process holds on the device then (weights and model buffers)
    peak_step: int  # what its largest step needs beyond that (0 where the probe profiles none)


def check_budget(memory: Budget) -> None:
    """Refuse a ``kv_cache_memory`` that is neither a fraction in (0, 1] nor a plausible byte count."""
    if isinstance(memory, bool) or not isinstance(memory, int | float):
        raise ValueError(f"kv_cache_memory={memory!r} must be bytes (an int) or a fraction in (0, 1] (a float)")
    if isinstance(memory, float) and not 0.0 < memory <= 1.0:
        raise ValueError(f"kv_cache_memory={memory!r}: a fraction of the device's memory must be in (0, 1]")
    if isinstance(memory, int) and memory < MIN_BUDGET_BYTES:
        raise ValueError(f"kv_cache_memory={memory!r} is a byte count below {MIN_BUDGET_BYTES} (1 MiB); "
                         f"write a float (1.0, 0.9) for a fraction of the device's memory")


def available_bytes(memory: Budget, use: MemoryUse, reserved: int = 0) -> tuple[int, str]:
    """Bytes the KV cache may take under ``memory``, and how that figure came about (for messages)."""
    total, free = use.report.total, use.report.free
    free_cap = free - use.peak_step - reserved
    after = (f"{gib(use.peak_step)} for the peak step and {gib(reserved)} reserved for transfers in flight")
    if isinstance(memory, int):
        return memory, f"{gib(free)} free now, less {after}, leaves {gib(free_cap)}"
    share = int(memory * total) - use.weights - use.peak_step - reserved
    why = f"{memory:g} of {gib(total)}, less {gib(use.weights)} of weights, {after}"
    if free_cap < share:
        return free_cap, f"{why}; capped by {gib(free)} free now"
    return share, why


def plan_num_blocks(memory: Budget, num_blocks: int | None, use: MemoryUse, block_nbytes: int, *,
                    reserved: int = 0, min_tokens: int = 1, block_size: int = 1) -> int:
    """The KV cache's block count under ``memory`` (see the module docstring); ``num_blocks``: the
    count asked for (checked), else derived; ``min_tokens``: a derived cache holds at least this many
    tokens (one sequence of ``max_model_len``) of ``block_size`` per block."""
    check_budget(memory)
    avail, why = available_bytes(memory, use, reserved)
    name = f"kv_cache_memory={memory!r}"
    if isinstance(memory, int):
        free_cap = use.report.free - use.peak_step - reserved
        if memory > free_cap:
            raise MemoryBudgetError(f"{name} ({gib(memory)}) does not fit the device: {why}")
    fits = max(0, avail) // block_nbytes
    if num_blocks is not None:
        if num_blocks > fits:
            raise MemoryBudgetError(
                f"{name} leaves {gib(max(0, avail))} for the KV cache ({why}); num_blocks={num_blocks} "
                f"need {gib(num_blocks * block_nbytes)} ({block_nbytes} bytes each): lower num_blocks, or "
                f"leave it unset to size the cache from the budget")
        return num_blocks
    need = -(-min_tokens // block_size)
    if fits < max(1, need):
        raise MemoryBudgetError(
            f"{name} leaves {gib(max(0, avail))} for the KV cache ({why}): {fits} blocks, but one sequence of "
            f"{min_tokens} tokens (max_model_len) needs {need} blocks ({gib(need * block_nbytes)})")
    return fits
