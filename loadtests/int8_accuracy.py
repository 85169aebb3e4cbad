"""The int8 accuracy check of `make bench-engine`: greedy agreement and log-likelihood vs the base model.

Owns: the fixed prompt set and text, greedy continuations on one `ModelRunner`, and
`int8_accuracy` (teacher-forced greedy agreement of the int8 runner with the base runner's greedy
tokens, free-running prefix agreement, and the mean negative log-likelihood of a fixed text under
each). Models without a tokenizer (the tiny test models) get fixed seeded random ids instead.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from engine.engine import Engine
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a short tip for learning to cook.",
    "Describe a cat to someone who has never seen one.",
]
TEXT = (
    "The river ran cold and clear through the valley, past the mill and the old stone bridge. In spring the "
    "water rose with the melting snow, and the children of the village would stand on the bank to watch "
    "branches and small pieces of ice float by. The miller, a patient man with flour in his beard, said the "
    "river had a memory: it always returned to the same bed, however far the floods had pushed it. Scientists "
    "who studied the valley later found that he was mostly right, although the channel had shifted by a few "
    "metres every century, carving new bends and abandoning old ones as oxbow lakes."
)


def prompt_ids(eng: Engine, n_random: int) -> list[list[int]]:
    try:
        from engine.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(eng.model_dir)
        return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    except Exception:  # a model without a tokenizer (the tiny test models): fixed random prompts
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, eng.model_config.vocab_size, (n_random,), generator=g).tolist() for _ in PROMPTS]


def text_ids(eng: Engine) -> list[int]:
    try:
        from engine.tokenizer import Tokenizer

        return list(Tokenizer.from_dir(eng.model_dir).encode(TEXT))
    except Exception:
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, eng.model_config.vocab_size, (96,), generator=g).tolist()


def _greedy(eng: Engine, runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    blocks = eng.pool.allocate(eng.blocks_for(len(prompt) + n))
    try:
        out = [int(runner.prefill([PrefillChunk(prompt, 0, blocks)]).argmax(-1))]
        while len(out) < n:
            out.append(int(runner.decode([DecodeSeq(out[-1], len(prompt) + len(out) - 1, blocks)]).argmax(-1)))
        return out
    finally:
        eng.pool.free(blocks)


def _all_logits(eng: Engine, runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    if runner.cache is not eng.cache:  # a runner with its own small cache: blocks 0.. are free
        return runner.prefill([PrefillChunk(ids, 0, list(range(eng.blocks_for(len(ids)))))], all_logits=True)
    blocks = eng.pool.allocate(eng.blocks_for(len(ids)))
    try:
        return runner.prefill([PrefillChunk(ids, 0, blocks)], all_logits=True)  # [S, V]
    finally:
        eng.pool.free(blocks)


def int8_accuracy(eng: Engine, base: ModelRunner, q8: ModelRunner, gen_tokens: int,
                  fp32: ModelRunner | None = None) -> dict[str, Any]:
    """Greedy agreement over the fixed prompts (``gen_tokens`` each) and the log-likelihood of a fixed text.

    ``fp32``, if given, is scored on the same greedy tokens: what plain bf16 rounding alone costs.
    """
    agree = total = identical = agree32 = 0
    prefix_frac = []
    for prompt in prompt_ids(eng, 24):
        ref = _greedy(eng, base, prompt, gen_tokens)
        # teacher-forced: the int8 model's argmax at every step of the reference continuation
        logits = _all_logits(eng, q8, prompt + ref[:-1])[len(prompt) - 1 :]
        agree += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
        if fp32 is not None:
            logits = _all_logits(eng, fp32, prompt + ref[:-1])[len(prompt) - 1 :]
            agree32 += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        mine = _greedy(eng, q8, prompt, gen_tokens)  # free-running
        same = next((i for i, (a, b) in enumerate(zip(ref, mine, strict=True)) if a != b), len(ref))
        prefix_frac.append(same / len(ref))
        identical += int(same == len(ref))
    ids = text_ids(eng)
    nll = {}
    for name, r in (("base", base), ("int8", q8)):
        lp = torch.log_softmax(_all_logits(eng, r, ids)[:-1], -1)
        nll[name] = float(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean())
    return {
        "prompts": len(PROMPTS), "tokens_per_prompt": gen_tokens,
        "greedy_agreement": agree / total,
        "fp32_greedy_agreement": agree32 / total if fp32 is not None else None,
        "free_running_prefix_fraction": statistics.mean(prefix_frac),
        "identical_continuations": identical,
        "text_tokens": len(ids), "nll_base": nll["base"], "nll_int8": nll["int8"],
        "nll_delta": nll["int8"] - nll["base"],
    }
