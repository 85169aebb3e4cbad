"""A Llama-3-style tokenizer folder whose post-processor adds BOS, built from the bundled tokenizer.

Owns: `make_bos_tokenizer_dir`, which copies SmolLM2's byte-level BPE and gives it what Llama 3's
``tokenizer.json`` has: a ``Sequence[ByteLevel, TemplateProcessing("<bos> $A")]`` post-processor,
``bos_token`` set to that token, and a chat template that writes ``{{ bos_token }}`` itself. SmolLM2's
own post-processor adds nothing, so without this folder a BOS bug would not show.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, processors

from tests.support.models import bundled_tokenizer_dir

BOS = "<|endoftext|>"  # id 0 in SmolLM2's vocabulary
BOS_ID = 0
EOS = "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_bos_tokenizer_dir(path: Path) -> Path:
    """``path`` (created) with tokenizer.json, tokenizer_config.json and a tiny Llama config.json."""
    path.mkdir(parents=True, exist_ok=True)
    source = bundled_tokenizer_dir()
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, BOS_ID)]),
    ])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "unk_token": BOS, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 2048, "bos_token_id": BOS_ID,
             "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(model))
    return path
