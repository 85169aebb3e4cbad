"""Tool-aware chat templates for tests, and tokenizer folders that carry them.

Owns: `QWEN2_5` (Qwen2.5-Instruct's template: Hermes-style ``<tool_call>`` JSON, tools in the system
prompt, tool answers as ``<tool_response>``) and `LLAMA3_1_JSON` (vLLM's Llama 3.1 JSON tool template:
``{"name": ..., "parameters": ...}``), read verbatim from ``tests/support/templates/``;
`set_chat_template` (a folder's ``tokenizer_config.json`` given another template) and
`tokenizer_with_template` (SmolLM2's tokenizer files under another template, for comparisons with
transformers' ``apply_chat_template``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.models import TOKENIZER_FILES, bundled_tokenizer_dir

_TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN2_5 = (_TEMPLATES / "qwen2_5.jinja").read_text()
LLAMA3_1_JSON = (_TEMPLATES / "llama3_1_json.jinja").read_text()


def set_chat_template(folder: Path, template: str) -> Path:
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return folder


def tokenizer_with_template(folder: Path, template: str) -> Path:
    """SmolLM2's tokenizer files copied to ``folder`` (created), with ``template`` as the chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    source = bundled_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return set_chat_template(folder, template)
