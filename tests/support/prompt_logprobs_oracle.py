"""The oracle of prompt log-probs: transformers' forward, an fp32 log-softmax at every position.

Owns: `hf_prompt_logprobs` (a prompt's per-position log-prob of the next prompt token, its rank and
the k most likely, from a transformers model) and `assert_close` (ours against it: values within
``atol``, top-k ids equal, ranks equal but for tokens within ``atol`` of each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling.prompt_logprobs import PromptLogprobs


@dataclass(frozen=True)
class Reference:
    token_logprobs: list[float]  # [n - 1]: log p(prompt[i] | prompt[:i]) for i >= 1
    rank_bounds: list[tuple[int, int]]  # [n - 1]: vLLM's rank (count of tokens at least as likely) with
    # every token within ``atol`` of the prompt token's log-prob counted out, then in
    top_ids: list[list[int]]  # [n - 1][k]
    top_logprobs: list[list[float]]  # [n - 1][k]


def hf_prompt_logprobs(hf: Any, prompt: Sequence[int], k: int, atol: float = 1e-4) -> Reference:
    with torch.no_grad():
        x = torch.tensor([list(prompt)])
        logits = hf(x, attention_mask=torch.ones_like(x)).logits[0, :-1].float()  # [n - 1, V]
    lp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(list(prompt[1:]))[:, None]  # [n - 1, 1]
    own = lp.gather(1, targets)  # [n - 1, 1]
    vals, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    lo, hi = (lp > own + atol).sum(-1) + 1, (lp >= own - atol).sum(-1)
    return Reference(own[:, 0].tolist(), list(zip(lo.tolist(), hi.tolist(), strict=True)), ids.tolist(),
                     vals.tolist())


def assert_close(ours: PromptLogprobs, ref: Reference, atol: float = 1e-4) -> None:
    assert len(ours) == len(ref.token_logprobs)
    torch.testing.assert_close(torch.tensor(ours.token_logprobs), torch.tensor(ref.token_logprobs),
                               atol=atol, rtol=0)
    assert [list(t) for t in ours.top_ids] == ref.top_ids
    torch.testing.assert_close(torch.tensor(ours.top_logprobs), torch.tensor(ref.top_logprobs), atol=atol, rtol=0)
    assert all(lo <= r <= hi for r, (lo, hi) in zip(ours.ranks, ref.rank_bounds, strict=True))
