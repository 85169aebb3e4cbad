"""The reference `generate()`: one sequence, prefill then decode, in one process.

Owns: the simplest correct use of the engine; every distributed path is tested against it.
Invariants: it allocates its own blocks and frees every one of them before returning, even on error.
A request with a grammar stops (``"stop"``) when the grammar is complete; a token the grammar
rejects raises `GrammarError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.engine import Engine
from engine.runner import DecodeSeq, PrefillChunk
from engine.sampling.grammar import GrammarError, grammar_vocab
from engine.sampling.sampler import SamplerState, SamplingParams, sample


@dataclass(frozen=True)
class GenerateOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] | None = None,
) -> GenerateOutput:
    """Generate up to ``params.max_tokens`` tokens after ``prompt_ids``."""
    eos = tuple(engine.model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    engine.check_length(len(prompt_ids), params.max_tokens)
    vocab = grammar_vocab(engine.model_dir, eos) if params.grammar is not None else None
    state = SamplerState.new(params, prompt_ids, eos_ids=eos, vocab=vocab)

    def stop(token: int) -> bool:
        if state.grammar is not None and state.grammar.error is not None:
            raise GrammarError(state.grammar.error)
        return params.is_stop(token, eos) or (state.grammar is not None and state.grammar.done)

    total = len(prompt_ids) + params.max_tokens
    blocks = engine.pool.allocate(engine.blocks_for(total))
    try:
        logits = engine.runner.prefill([PrefillChunk(list(prompt_ids), 0, blocks)])
        first = sample(logits, [state])
        out, out_lp = [first.token_ids[0]], [first.logprobs[0]]
        pos = len(prompt_ids)
        redo = engine.model_config.rope_recompute_position
        while len(out) < params.max_tokens and not stop(out[-1]):
            history = [*prompt_ids, *out[:-1]] if pos == redo else None
            logits = engine.runner.decode([DecodeSeq(out[-1], pos, blocks, history)])
            step = sample(logits, [state])
            out.append(step.token_ids[0])
            out_lp.append(step.logprobs[0])
            pos += 1
        reason = "stop" if stop(out[-1]) else "length"
        return GenerateOutput(out, out_lp, reason)
    finally:
        engine.pool.free(blocks)
