"""The bundled SmolLM2-135M-Instruct: our greedy output equals transformers' greedy generate, on the
default attention backend and on the torch backend (FlexAttention, eager on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]

pytestmark = pytest.mark.timeout(300)


#: the backend a CPU serves with: every prompt, 32 tokens; the torch backend (eager flex on a CPU: slow,
#: and it reads every cache slot): the first prompt, 16 tokens, with the few blocks one generation holds
ENGINES = {"auto": (EngineConfig(num_blocks=64, block_size=16), PROMPTS, 32),
           "torch": (EngineConfig(num_blocks=8, block_size=16, backend="torch"), PROMPTS[:1], 16)}


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_greedy_tokens_equal_transformers(smollm_dir: Path, backend: str) -> None:
    import transformers

    tok = Tokenizer.from_dir(smollm_dir)
    config, prompts, new = ENGINES[backend]
    eng = Engine.from_dir(smollm_dir, config)
    assert backend == "auto" or eng.runner.model.attention.name == backend
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate all ``new`` tokens, like ignore_eos on our side
    for prompt in prompts:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        ours = generate(eng, ids, SamplingParams(max_tokens=new, ignore_eos=True), eos_token_ids=())
        with torch.no_grad():
            # EOS disabled on both sides, so all ``new`` tokens are compared (the text runs on past the answer).
            # An explicit mask: pad == eos == <|im_end|> appears inside the chat prompt, and
            # transformers would otherwise infer those positions are padding.
            x = torch.tensor([ids])
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                pad_token_id=tok.eos_token_ids[0],
            )[0, len(ids):].tolist()
        assert ours.token_ids == ref, (prompt, tok.decode(ours.token_ids), tok.decode(ref))
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    if backend != "auto":
        return  # its tokens are transformers' (above); what the model answers is checked once, below
    chat = tok.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    answer = tok.decode(generate(eng, chat, SamplingParams(max_tokens=16)).token_ids)
    assert "Paris" in answer
