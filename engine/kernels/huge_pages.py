"""Large CPU tensors on transparent huge pages (2 MiB) where the kernel allows it.

Owns: `huge_zeros`, the KV cache's allocator (`engine.kv_cache`), and `huge_page_bytes`, which
reads back how much of a tensor the kernel actually backs with huge pages (for tests and logs).

Why: decode attention reads every sequence's blocks through its block table, 6-12 KiB at a time
from anywhere in a cache of a gigabyte or more; on 4 KiB pages that is a TLB miss every few KiB and
the hardware prefetchers stop at each page edge. On 2 MiB pages the misses are rare and the
prefetchers run on (figures: docs/benchmarks-notes.md).

Invariants: the result is an ordinary contiguous zeroed tensor whatever happens; the advice is a
hint (``MADV_HUGEPAGE`` on a fresh 2 MiB-aligned mapping, given before the first write, so the pages
are faulted in huge), never an error: no Linux, THP set to ``never`` or a refused call leave plain
pages. Only CPU tensors of at least 2 MiB get a mapping of their own. torch's switch for every
allocation (``THP_MEM_ALLOC_ENABLE=1``) advises its own buffers process-wide, but only if set before
the first allocation, and a buffer the allocator reuses may already sit on plain pages.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE = 2 * 2**20


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``, on huge pages where a CPU tensor of >= 2 MiB can have them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # A fresh anonymous mapping (never heap memory an earlier tensor already faulted in), 2 MiB spare
    # so the tensor can start on a 2 MiB boundary; the tensor keeps the mapping alive. Private: a shared
    # anonymous mapping (mmap's default) is shmem, which has its own THP switch (usually never).
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    off = -whole.data_ptr() % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    except OSError:  # THP compiled out or refused: plain pages
        pass
    return whole[off : off + nbytes].view(dtype).view(shape).zero_()  # faults every page in now


def huge_page_bytes(t: torch.Tensor) -> int | None:
    """Bytes of the mappings overlapping ``t`` that the kernel backs with huge pages (from
    ``/proc/self/smaps``; None where that file is missing)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    lo, hi, total, inside = t.data_ptr(), t.data_ptr() + t.nbytes, 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def thp_mode() -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise`` or ``never``), None if unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else None
