"""Sampling parameters and the batched sampler.

Owns: `SamplingParams` (what a request asks for), `SamplingDefaults` (what a model asks for when the
request does not), `SamplerState` (one sequence's prompt, output and penalty book) and `sample()`
(a step's logits → token ids, their log-probs and the most likely alternatives, `Sampled`).

The pipeline, over the step's rows (vLLM's order; a stage runs only when some row needs it, so
plain requests pay for none of them):

1. ``logit_bias`` added; the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) masked
   while the output is shorter than ``min_tokens``; then the grammar's mask (structured outputs,
   `engine.sampling.grammar.mask_logits`: what the grammar does not allow next at -inf);
2. repetition penalty (transformers' definition: over prompt and output tokens, a positive logit
   divided by it, a negative one multiplied), then frequency and presence penalties (OpenAI's:
   ``logit - count * frequency - (count > 0) * presence`` over the output tokens), as a gather and
   a scatter over only the ids in each row's `PenaltyBook`;
3. greedy rows (``temperature == 0``) take the argmax here; for the others, min-p (tokens below
   ``min_p`` times the top probability), top-k (ties with the k-th kept) and top-p (the smallest
   head whose mass reaches ``top_p``, with the tokens tied with its last) at the row's temperature
   become one cut per row, and a token is drawn from the softmax of what is left by inverse CDF
   from one uniform number (engine/sampling/draw.py says how, and why on the host for CPU logits).

Two paths run this pipeline: CPU logits go to numpy after stage 2 (engine/sampling/draw.py);
logits on a device stay there, as batched torch ops with one copy back per step
(engine/sampling/device.py, which says where rounding may part the two). Stages 1 and 2 and the
uniforms are the same functions in both (engine/sampling/stages.py).

Invariants: a request with a ``seed`` draws token ``t`` from the number of a generator seeded from
``(seed, t)``, and a row's cut and draw read nothing of the other rows, so its text depends only on
the seed, not on the batch it ran in nor on which process sampled which token (token 0 on a prefill
replica, the rest on a decode replica gives the same text as colocated); a decode replica rebuilds
a state from the prompt and the tokens so far (a grammar's matcher too, by replaying them). Greedy
rows take the argmax of the masked logits.
The log-probabilities returned (the chosen token's and the ``top_logprobs`` most likely) are of the
*unmodified* distribution (no bias, penalty, temperature or truncation), as OpenAI's API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.sampling import device
from engine.sampling.draw import argmax, draw, host, truncate
from engine.sampling.grammar import (
    mask_logits,
)
from engine.sampling.params import (
    MAX_TOP_LOGPROBS,
    PenaltyBook,
    SamplerState,
    SamplingDefaults,
    SamplingParams,
)
from engine.sampling.stages import Sampled, TopLogprobs, adjusted, bias_and_min_tokens, penalties, uniforms

__all__ = ["MAX_TOP_LOGPROBS", "PenaltyBook", "Sampled", "SamplerState", "SamplingDefaults", "SamplingParams",
           "TopLogprobs", "bias_and_min_tokens", "penalties", "sample"]

def _top(raw: torch.Tensor, lse: torch.Tensor, states: Sequence[SamplerState]) -> list[TopLogprobs]:
    """raw: [B, V] unmodified logits, lse: [B] their logsumexp → each row's most likely tokens."""
    ks = [st.params.top_logprobs for st in states]
    if not any(ks):
        return [() for _ in states]
    vals, idx = torch.topk(raw, max(ks), dim=-1)  # [B, kmax]
    lps, ids = (vals - lse.unsqueeze(1)).tolist(), idx.tolist()
    return [tuple(zip(ids[i][:k], lps[i][:k], strict=True)) for i, k in enumerate(ks)]


def sample(logits: torch.Tensor, states: list[SamplerState], on_device: bool | None = None) -> Sampled:
    """logits: [B, V], one row per state → the chosen tokens, their log-probs and the top alternatives.

    Records each chosen token in its state. Logits off the CPU are sampled where they are
    (`engine.sampling.device`: batched torch ops, one copy back), CPU logits by numpy;
    ``on_device`` picks the path instead (True: the device path on CPU logits too, as tests run it).
    """
    if on_device is None:
        on_device = logits.device.type != "cpu"
    out = device.choose(logits, states) if on_device else _on_host(logits, states)
    for st, tok in zip(states, out.token_ids, strict=True):
        st.record(tok)
    return out


def _on_host(logits: torch.Tensor, states: list[SamplerState]) -> Sampled:
    """The pipeline with its cut and draw in numpy (engine/sampling/draw.py); records nothing."""
    raw = logits.float()  # [B, V]
    params = [st.params for st in states]
    x = adjusted(raw, states, mask_logits)
    hot = [i for i, p in enumerate(params) if not p.greedy]
    ids = argmax(x) if len(hot) < len(states) else np.empty(len(states), dtype=np.int64)  # [B]
    if hot:
        a = host(x if len(hot) == len(states) else x[hot])  # [b, V]
        sub = [params[i] for i in hot]
        cut = truncate(a, sub)  # [b]: temperature, min-p, top-k, top-p
        temps = np.array([p.temperature for p in sub])
        ids[hot] = draw(a, cut, temps, uniforms([states[i] for i in hot]))
    chosen_ids = torch.from_numpy(ids).to(raw.device)
    lse = raw.logsumexp(dim=-1)  # [B]
    chosen = raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1) - lse  # [B]
    return Sampled(ids.tolist(), chosen.tolist(), _top(raw, lse, states))
