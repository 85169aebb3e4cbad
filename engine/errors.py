"""Exceptions the engine raises; each message names the cause and, where there is one, the file."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model could not be loaded: unknown architecture, missing/corrupt file, config mismatch."""


class MemoryBudgetError(ModelLoadError):
    """The KV cache asked for (``num_blocks``, ``kv_cache_memory``) does not fit the device's memory."""


class ContextLengthError(EngineError, ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class NoFreeBlocksError(EngineError):
    """The KV block pool has fewer free blocks than asked for."""


class QueueFullError(EngineError):
    """A worker's queue is at its bound; the caller should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float]]:  # survives pickling through Ray
        return (QueueFullError, (str(self), self.retry_after_s))
