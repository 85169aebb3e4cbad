"""The registry of attention backends: name → module, imported only when picked.

Owns: `backend_class` (a name of `engine.attention.names.BACKENDS` → its class, imported then)
and `pick_backend`, which builds the backend an engine asks for or says why it cannot.

Invariants: importing this module imports no backend (so reading a config never loads kernel
machinery); a backend is one module holding one `AttentionBackend` subclass named in its
``BACKEND`` attribute, plus one line in `engine.attention.names`; ``"auto"`` means ``cpu`` on a CPU and ``torch``
elsewhere, falling back to ``torch`` then ``reference`` where the first cannot run (logged, with
the reason); an explicitly named backend that cannot run is refused with its reason, never
replaced by another.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from engine.attention.names import BACKENDS

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend, AttentionSpec
    from engine.config import EngineConfig

log = logging.getLogger(__name__)



class BackendUnavailable(RuntimeError):
    """The named attention backend cannot run this model here (the message says why)."""


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected 'auto' or one of {sorted(BACKENDS)}")
    cls: type[AttentionBackend] = importlib.import_module(BACKENDS[name]).BACKEND
    return cls


def auto_order(device: str) -> tuple[str, ...]:
    """The backends ``"auto"`` tries on ``device``, best first."""
    return ("cpu", "torch", "reference") if device.startswith("cpu") else ("torch", "reference")


def pick_backend(spec: AttentionSpec, config: EngineConfig) -> AttentionBackend:
    """The backend ``config.backend`` names (or ``"auto"``'s first that runs), built for ``spec``."""
    if config.backend != "auto":
        cls = backend_class(config.backend)
        if (why := cls.unavailable(spec, config)) is not None:
            raise BackendUnavailable(f"attention backend {config.backend!r} cannot run here: {why}")
        return cls(spec, config)
    reasons: list[str] = []
    for name in auto_order(config.device):
        cls = backend_class(name)
        if (why := cls.unavailable(spec, config)) is None:
            if reasons:
                log.info("attention backend auto: %s (%s)", name, "; ".join(reasons))
            return cls(spec, config)
        reasons.append(f"{name}: {why}")
    raise BackendUnavailable("no attention backend can run here: " + "; ".join(reasons))
