"""A prompt's log-probs (`engine.sampling.prompt_logprobs.PromptLogprobs`) in the API's two shapes.

Owns: vLLM's ``prompt_logprobs`` list (`PromptLogprob`, `vllm_prompt_logprobs`: on a completions
choice, on a chat response) and the echoed prompt's entries of a legacy completions ``logprobs``
object (`echoed_entries`: OpenAI's ``echo`` with ``logprobs``).

Invariants: both have one entry per prompt token, the first without a log-prob (vLLM: None;
completions: ``token_logprobs`` None and ``top_logprobs`` None), as vLLM answers. A vLLM entry maps
token id -> `PromptLogprob`: the prompt's token first (its rank counted over the vocabulary), then
the k most likely with ranks 1..k (the prompt's token once if it is among them). Log-probs are
clamped at -9999.0 as vLLM does, so JSON never holds ``-Infinity``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import TopLogprobs
from router.codec import TextCodec

#: the most negative log-prob sent (vLLM's and OpenAI's stand-in for -inf)
FLOOR = -9999.0


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's log-prob at a prompt position, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs``: per prompt position (the first: None) token id -> its `PromptLogprob`
PromptLogprobsList = list[dict[int, PromptLogprob] | None]


def vllm_prompt_logprobs(prompt: Sequence[int], scores: PromptLogprobs, codec: TextCodec) -> PromptLogprobsList:
    _check(prompt, scores)
    out: PromptLogprobsList = [None]
    for i, tid in enumerate(prompt[1:]):
        entry = {tid: PromptLogprob(logprob=max(scores.token_logprobs[i], FLOOR), rank=scores.ranks[i],
                                    decoded_token=codec.token_text(tid))}
        for rank, (alt, lp) in enumerate(zip(scores.top_ids[i], scores.top_logprobs[i], strict=True), 1):
            entry[alt] = PromptLogprob(logprob=max(lp, FLOOR), rank=rank, decoded_token=codec.token_text(alt))
        out.append(entry)
    return out


def echoed_entries(prompt: Sequence[int], scores: PromptLogprobs, k: int
                   ) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """Per prompt token: its log-prob and the alternatives to list with it (the first: None, None),
    in the per-token form the completions formatter takes for generated tokens. The alternatives
    are vLLM's: the first ``k + 1`` of its position's entries (the token itself, then the most
    likely), so ``prompt_logprobs`` above ``logprobs`` lists no more than ``logprobs`` asks."""
    _check(prompt, scores)
    lps: list[float | None] = [None, *(max(lp, FLOOR) for lp in scores.token_logprobs)]
    tops: list[TopLogprobs | None] = [None]
    for tid, own, ids, vals in zip(prompt[1:], scores.token_logprobs, scores.top_ids, scores.top_logprobs,
                                   strict=True):
        entry = {tid: own, **{t: v for t, v in zip(ids, vals, strict=True) if t != tid}}
        tops.append(tuple((t, max(v, FLOOR)) for t, v in list(entry.items())[: k + 1]))
    return lps, tops


def _check(prompt: Sequence[int], scores: PromptLogprobs) -> None:
    if len(scores) != len(prompt) - 1:
        raise ValueError(f"{len(scores)} prompt log-probs for a prompt of {len(prompt)} tokens")
