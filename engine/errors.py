"""Exceptions the engine raises; each message names the cause and, where there is one, the file.

`missing_dependency` wraps the import of a package that only some paths use (GGUF conversion,
grammars, the KV control channel's codec, the host memory probe): those modules import it on first
use, so the rest of the engine runs where it is absent (the GPU image ``make gpu-check`` runs on has
torch, transformers and cupy only), and a path that needs it fails with `MissingDependencyError`
naming the package and how to install it, never a bare ``ModuleNotFoundError`` deep in a call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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


class MissingDependencyError(EngineError, ImportError):
    """A package that only some paths need is not installed; the message says which and how to get it."""


@contextmanager
def missing_dependency(package: str, needed_for: str) -> Iterator[None]:
    """Around ``import package``: its absence becomes `MissingDependencyError` saying that
    ``needed_for`` needs ``package`` (a dependency of pdserve, installed with it); any other import
    error passes through unchanged."""
    try:
        yield
    except ImportError as e:
        if e.name is None or e.name.partition(".")[0] != package:
            raise
        raise MissingDependencyError(
            f"{needed_for} needs the {package!r} package, which is not installed here: "
            f"`pip install {package}` (one of pdserve's dependencies: `pip install -e .` installs them all)",
            name=package) from e
