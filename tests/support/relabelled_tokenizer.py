"""Tokenizer folders whose labels and ``tokenizer.json`` disagree, built from the bundled tokenizer.

Owns: `make_relabelled_dir`, which copies SmolLM2's BPE vocabulary into a folder with a chosen
``config.json`` ``model_type``, ``tokenizer_config.json`` ``tokenizer_class`` and pipeline form. transformers
5 builds a model-specific class for some of these (``Qwen2Tokenizer`` for a qwen2 config over a plain
ByteLevel pre-tokenizer) and tokenizes with that class's pipeline, not the file's: the cases
`engine.tokenizer_class` must follow.

Pipeline forms: ``bundled`` (SmolLM2's own: Digits then ByteLevel), ``byte_level`` (a plain ByteLevel
pre-tokenizer, as GPT-2 saves it), ``metaspace`` (a SentencePiece-style file: Metaspace pre-tokenizer,
byte-fallback decoder, no ByteLevel step anywhere, so a ``LlamaTokenizer`` label keeps Llama's class).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.models import bundled_tokenizer_dir

FORMS = ("bundled", "byte_level", "metaspace")


def _pipeline(data: dict[str, Any], form: str) -> dict[str, Any]:
    if form == "byte_level":
        data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                 "use_regex": True}
    elif form == "metaspace":
        data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        replace = {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}
        data["decoder"] = {"type": "Sequence", "decoders": [replace, {"type": "ByteFallback"}, {"type": "Fuse"}]}
        data["post_processor"] = None
        data["model"]["byte_fallback"] = True
        assert '"ByteLevel"' not in json.dumps(data)
    elif form != "bundled":
        raise ValueError(f"unknown pipeline form {form!r}; one of {FORMS}")
    return data


def make_relabelled_dir(path: Path, model_type: str, tokenizer_class: str | None, form: str = "bundled",
                        **config: Any) -> Path:
    """``path`` (created): the bundled vocabulary under ``model_type`` and ``tokenizer_class`` (None: not
    declared), its pipeline in ``form``; ``config``: more tokenizer_config.json keys."""
    path.mkdir(parents=True, exist_ok=True)
    source = bundled_tokenizer_dir()
    data = _pipeline(json.loads((source / "tokenizer.json").read_text()), form)
    (path / "tokenizer.json").write_text(json.dumps(data))
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    tok_config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tok_config["tokenizer_class"] = tokenizer_class
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_config, **config}))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path
