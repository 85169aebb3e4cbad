"""The attention backends' names and the module that holds each (imports nothing).

Owns: `BACKENDS`, which `engine.config.EngineConfig` validates ``backend`` against and
`engine.attention.registry` imports from: adding a backend is one module plus one line here.
"""

from __future__ import annotations

#: name → module holding the backend class (its ``BACKEND`` attribute)
BACKENDS: dict[str, str] = {
    "reference": "engine.attention.reference",
    "cpu": "engine.attention.cpu",
    "torch": "engine.attention.torch_backend",
}
