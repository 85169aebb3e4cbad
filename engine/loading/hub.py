"""Hugging Face hub ids (``Qwen/Qwen3-0.6B``) → a model folder in ``huggingface_hub``'s own cache.

Owns: `is_hub_id` (the shape of an id) and `hub_model_dir`, which finds or downloads what the engine
reads of one repository.

Invariants:
- Only what the engine reads is fetched: the JSON files in `METADATA_FILES`, then the weights the
  safetensors index names (else ``model.safetensors``), never a repository's other copies of the
  weights (``consolidated.safetensors``, ``*.bin``, ``original/``).
- Where the cache lives, whether downloads are allowed and the access token are
  ``huggingface_hub``'s own settings (``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``,
  ``HF_TOKEN``), read by it as every Hugging Face tool reads them.
- A folder is returned only with ``config.json``, ``tokenizer.json`` and every weight file in it;
  otherwise `ModelLoadError` names the id, the cache and what is missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "model.safetensors.index.json")
REQUIRED_FILES = ("config.json", "tokenizer.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub id (``org/name``); a local path of that shape wins."""
    return _HUB_ID.fullmatch(name) is not None and not name.endswith((".gguf", "/.", "/.."))


def _weight_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None


def _silent_tqdm() -> Any:
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent


def hub_model_dir(repo_id: str, progress: bool = True) -> Path:
    """The snapshot folder of ``repo_id``'s main revision, downloaded first unless it is cached.

    Offline (``HF_HUB_OFFLINE=1``) only the cache is read; online ``snapshot_download`` fetches what
    is missing, with its progress bars when ``progress``.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    bars = None if progress else _silent_tqdm()
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=list(METADATA_FILES), tqdm_class=bars))
        weights = _weight_files(folder)
        if not all((folder / w).is_file() for w in weights):
            folder = Path(snapshot_download(repo_id, allow_patterns=weights, tqdm_class=bars))
    except LocalEntryNotFoundError as e:
        why = ("downloads are off (HF_HUB_OFFLINE=1)" if offline
               else f"the hub did not give it: {e.__cause__ or e}")
        raise ModelLoadError(f"hub model {repo_id!r}: not in {where}, and {why}; fetch it where the hub can "
                             f"be reached (`pdserve prepare-model {repo_id}`) or point HF_HUB_CACHE at a "
                             f"cache that holds it") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"hub model {repo_id!r}: cannot download it into {where}: {e}") from None
    missing = [f for f in (*REQUIRED_FILES, *_weight_files(folder)) if not (folder / f).is_file()]
    if missing:
        hint = " (downloads are off: HF_HUB_OFFLINE=1)" if offline else " (the repository does not have them)"
        raise ModelLoadError(f"hub model {repo_id!r}: {folder} in {where} lacks {', '.join(missing)}{hint}")
    return folder


def cached_file(repo_id: str, name: str) -> Path | None:
    """``name`` of ``repo_id``'s main revision where huggingface_hub's cache holds it, else None (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, name)
    return Path(found) if isinstance(found, str) else None
