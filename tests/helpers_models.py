"""A tiny random Llama that speaks SmolLM2's tokenizer: real model folders for serving tests.

Owns: `make_tiny_chat_model`, which saves a 2-layer random Llama with SmolLM2's vocabulary (49,152
ids) next to copies of the bundled model's ``tokenizer.json`` / ``tokenizer_config.json`` (so the
chat template, EOS ids and detokenizer are the real ones), and `bundled_tokenizer_dir`.

Why: tests whose point is the serving machinery (kills, disconnects, backpressure, soak) need real
replicas with a real tokenizer, but not SmolLM2's 30 layers: this model loads in well under a
second and decodes a token in about a millisecond, so hundreds of requests fit in a test.
Its output is random text (use ``ignore_eos`` where token counts matter).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.bundled import DEFAULT_MODEL, prepare_model

VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def bundled_tokenizer_dir() -> Path:
    """The prepared bundled model folder (converted once, cached in ``~/.cache/pdserve/models``)."""
    return prepare_model(DEFAULT_MODEL, progress=False)


def make_tiny_chat_model(path: Path, *, seed: int = 0, max_position_embeddings: int = 4096,
                         hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Save a tiny random Llama with SmolLM2's tokenizer to ``path`` (created) and return it."""
    from tests.tiny_models import make_tiny

    path.mkdir(parents=True, exist_ok=True)
    make_tiny("llama", path, seed=seed, vocab_size=VOCAB_SIZE, hidden_size=hidden_size,
              intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    source = bundled_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return path
