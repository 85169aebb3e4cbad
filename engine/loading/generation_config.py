"""What a model folder says about generating: the ids that end it and the default sampling settings.

Owns: `GenerationConfig`, read from ``config.json`` and ``generation_config.json``.

Invariants:
- ``eos_token_ids`` is the union, in order and without duplicates, of ``config.json``'s and
  ``generation_config.json``'s ``eos_token_id`` (each an int or a list of ints): Llama 3 Instruct,
  for one, names ``<|eot_id|>`` only in its generation config.
- ``sampling`` holds only what ``generation_config.json`` writes (``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the default ``max_tokens``:
  what vLLM's ``--generation-config auto`` takes, bar the penalties the API names alike); a request's
  own values win over it, as with vLLM's ``--generation-config auto``. ``max_length`` (prompt and
  output together) is not read, as vLLM does not read it.
- A value of the wrong type is a `ModelLoadError` naming the file and the field, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.sampling.sampler import SamplingDefaults

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def read_json_object(path: Path) -> dict[str, Any]:
    """A model folder's JSON file as a dict; {} when it is absent, ModelLoadError when it is malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any, where: str) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ModelLoadError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(items)


def _number(data: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ModelLoadError(f"{where}: {name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class GenerationConfig:
    """The stop ids and sampling defaults of one model folder; build with `GenerationConfig.from_dir`."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    @classmethod
    def from_dir(cls, path: str | Path) -> GenerationConfig:
        folder = Path(path)
        model, gen = read_json_object(folder / CONFIG), read_json_object(folder / GENERATION_CONFIG)
        where = str(folder / GENERATION_CONFIG)
        eos = (*_ids(model.get("eos_token_id"), str(folder / CONFIG)), *_ids(gen.get("eos_token_id"), where))
        try:
            sampling = SamplingDefaults(temperature=_number(gen, "temperature", float, where),
                                        top_p=_number(gen, "top_p", float, where),
                                        top_k=_number(gen, "top_k", int, where),
                                        min_p=_number(gen, "min_p", float, where),
                                        repetition_penalty=_number(gen, "repetition_penalty", float, where),
                                        max_tokens=_number(gen, "max_new_tokens", int, where))
        except ValueError as e:
            raise ModelLoadError(f"{where}: {e}") from None
        return cls(eos_token_ids=tuple(dict.fromkeys(eos)), sampling=sampling)
