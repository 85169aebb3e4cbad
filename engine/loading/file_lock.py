"""`file_lock`: an exclusive lock between processes on one machine, held by a lock file.

Owns the one lock primitive the engine shares: a converted-model folder is written by one process
at a time (`engine.loading.bundled`), and engines on one machine time their kernels one at a time
(`engine.engine.timing_lock`), so two replicas starting together do not measure each other.

Invariants: ``flock`` on an open file, so the lock is released when its holder exits or dies;
it serializes processes (and threads, each opening the file afresh), never re-entrant.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
