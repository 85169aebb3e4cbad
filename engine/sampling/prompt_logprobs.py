"""Prompt log-probs: for each prompt position i >= 1, log p(token i | tokens < i), its rank, and the
k most likely tokens there (OpenAI's ``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``).

Owns: `PromptLogprobs`, the compact result (plain tuples, so it crosses Ray as a pickle and
msgpack as lists); `ScoreAsk`, what one prefill chunk asks for (the tokens its rows predict, k);
and `score_rows`, which turns a chunk's final hidden states into its entries through the model's
lm_head, ``ROWS_PER_PASS`` rows at a time, with an fp32 log-softmax over the whole vocabulary.

Invariants: entry j of a prompt's result is position j + 1 (position 0 has no context, so no
entry: a prompt of n tokens has n - 1); a row predicts the token after it, so a chunk's last row
scores the next chunk's first token and a prompt prefilled in chunks gets the entries of one-shot
(up to float reassociation); the prompt's last row predicts token 0, which the sampler draws and
is not scored here. Ranks are vLLM's: 1 + the tokens strictly more likely, ties counted
(``count(logprob >= the token's)``). Memory beyond the forward is one ``[ROWS_PER_PASS, vocab]``
fp32 block, whatever the prompt's length. Only chunks that ask pay for any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.device_copy import host_tensor
from engine.sampling.sampler import MAX_TOP_LOGPROBS

#: rows of the lm_head and log-softmax computed at once: bounds the ``[rows, vocab]`` fp32 block
ROWS_PER_PASS = 128


@dataclass(frozen=True)
class PromptLogprobs:
    """Entries for consecutive prompt positions (the first prompt position with context first)."""

    token_logprobs: tuple[float, ...] = ()  # [P] log p(the prompt's token | the tokens before it)
    ranks: tuple[int, ...] = ()  # [P] that token's rank in its distribution (1: the most likely)
    top_ids: tuple[tuple[int, ...], ...] = ()  # [P][k] the k most likely tokens there, the most likely first
    top_logprobs: tuple[tuple[float, ...], ...] = ()  # [P][k] their log-probs

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def __add__(self, later: PromptLogprobs) -> PromptLogprobs:
        """These entries followed by ``later``'s (a prompt's chunks, in order)."""
        return PromptLogprobs(self.token_logprobs + later.token_logprobs, self.ranks + later.ranks,
                              self.top_ids + later.top_ids, self.top_logprobs + later.top_logprobs)


@dataclass(frozen=True)
class ScoreAsk:
    """A prefill chunk's ask: score its rows against ``targets`` (the prompt tokens after each row:
    one per row, or one fewer in the prompt's last chunk), with the ``top_k`` most likely."""

    targets: tuple[int, ...]
    top_k: int


@torch.inference_mode()
def score_rows(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, ask: ScoreAsk
               ) -> PromptLogprobs:
    """``hidden`` [R, hidden]: the final hidden states of a chunk's rows (R >= len(targets)), as
    ``logits`` (the model's lm_head, fp32 [r, vocab] from [r, hidden]) takes them."""
    n = len(ask.targets)
    if n > hidden.shape[0]:
        raise ValueError(f"{n} targets for a chunk of {hidden.shape[0]} rows")
    targets = host_tensor(ask.targets, hidden.device)  # [n]
    own: list[float] = []
    ranks: list[int] = []
    top_ids: list[tuple[int, ...]] = []
    top_lps: list[tuple[float, ...]] = []
    for lo in range(0, n, ROWS_PER_PASS):
        hi = min(lo + ROWS_PER_PASS, n)
        lp = torch.log_softmax(logits(hidden[lo:hi]).float(), dim=-1)  # [r, V]
        mine = lp.gather(1, targets[lo:hi, None])  # [r, 1]
        own.extend(mine[:, 0].tolist())
        ranks.extend((lp >= mine).sum(-1).tolist())
        if ask.top_k:
            vals, ids = lp.topk(min(ask.top_k, lp.shape[-1]), dim=-1)  # [r, k] each, the most likely first
            top_ids.extend(tuple(row) for row in ids.tolist())
            top_lps.extend(tuple(row) for row in vals.tolist())
        else:
            top_ids.extend(() for _ in range(hi - lo))
            top_lps.extend(() for _ in range(hi - lo))
    return PromptLogprobs(tuple(own), tuple(ranks), tuple(top_ids), tuple(top_lps))


def check_prompt_logprobs(top_k: int | None) -> None:
    """Refuse (ValueError) an ask no forward should meet: checked when a request arrives, so a bad one
    fails alone instead of failing the forward it would share."""
    if top_k is not None and not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_k}")


def chunk_ask(prompt: Sequence[int], start: int, n: int, top_k: int | None) -> ScoreAsk | None:
    """The ask of the chunk of ``prompt`` at ``start`` of ``n`` tokens, for a request that wants
    ``top_k`` alternatives per position (None: it wants no prompt log-probs)."""
    if top_k is None:
        return None
    return ScoreAsk(tuple(prompt[start + 1 : start + n + 1]), top_k)
