"""Prompt log-probs from the prefill forward (`ModelRunner.prefill_scored`) against transformers'
log-softmax at every position: one-shot, chunked (the chunks' entries joined), beside plain chunks
in one forward, and through every attention backend (``cpu``, ``reference``, ``torch``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import PrefillChunk
from engine.sampling.prompt_logprobs import ROWS_PER_PASS, PromptLogprobs, chunk_ask
from tests.support.prompt_logprobs_oracle import assert_close, hf_prompt_logprobs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def hf(tiny_path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


#: every attention backend (`engine.attention.registry`) against the same oracle
BACKENDS = ("cpu", "reference", "torch")


def engine(path: Path, backend: str = "cpu") -> Engine:
    # eager flex reads every cache slot: the torch backend gets the blocks the longest prompt needs (11)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=12 if backend == "torch" else 64, block_size=16,
                                             dtype="float32", backend=backend))
    assert eng.runner.model.attention.name == backend
    return eng


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def scored_in_chunks(eng: Engine, prompt: list[int], size: int, k: int) -> tuple[PromptLogprobs, torch.Tensor]:
    """The prompt prefilled ``size`` tokens a forward; its entries joined, and the last row's logits."""
    blocks = eng.pool.allocate(eng.blocks_for(len(prompt)))
    total = PromptLogprobs()
    try:
        for start in range(0, len(prompt), size):
            n = min(size, len(prompt) - start)
            chunk = PrefillChunk(prompt[start : start + n], start, blocks)
            logits, (part,) = eng.runner.prefill_scored([chunk], [chunk_ask(prompt, start, n, k)])
            assert part is not None
            total = total + part
    finally:
        eng.pool.free(blocks)
    return total, logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [1000, 16, 7])
def test_one_shot_and_chunked_equal_transformers(tiny_path: Path, hf, backend: str, size: int) -> None:
    """Every position's log-prob, rank and top 5 (a prompt longer than one lm_head pass), whole or in
    chunks that do and do not end on block boundaries."""
    eng = engine(tiny_path, backend)
    prompt = prompt_of(ROWS_PER_PASS + 45, seed=size)
    ours, last = scored_in_chunks(eng, prompt, size, k=5)
    assert_close(ours, hf_prompt_logprobs(hf, prompt, 5))
    with torch.no_grad():  # token 0's logits are still the last row's
        want = hf(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(last[0], want, atol=1e-4, rtol=0)


def test_k_zero_scores_the_prompt_tokens_alone(tiny_path: Path, hf) -> None:
    ours, _ = scored_in_chunks(engine(tiny_path), prompt_of(40, seed=1), 40, k=0)
    assert ours.top_ids == ((),) * 39
    assert_close(ours, hf_prompt_logprobs(hf, prompt_of(40, seed=1), 0))


def test_scoring_one_chunk_leaves_the_others_logits_unchanged(tiny_path: Path, hf) -> None:
    """A forward with a scored prompt beside plain ones: the plain rows' logits are those of `prefill`
    bit for bit, and the scored prompt's entries are transformers'."""
    eng = engine(tiny_path)
    prompts = [prompt_of(n, seed=n) for n in (30, 50, 9)]
    tables = [eng.pool.allocate(eng.blocks_for(len(p))) for p in prompts]
    chunks = [PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    plain = eng.runner.prefill(chunks)
    logits, scored = eng.runner.prefill_scored(chunks, [None, chunk_ask(prompts[1], 0, 50, 3), None])
    assert torch.equal(logits, plain)
    assert scored[0] is None and scored[2] is None and scored[1] is not None
    assert_close(scored[1], hf_prompt_logprobs(hf, prompts[1], 3))
    for t in tables:
        eng.pool.free(t)


def test_a_one_token_prompt_has_no_entries(tiny_path: Path) -> None:
    ours, _ = scored_in_chunks(engine(tiny_path), [5], 16, k=2)
    assert len(ours) == 0
