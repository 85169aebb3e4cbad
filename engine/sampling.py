"""Sampling parameters and the batched sampler.

Owns: `SamplingParams` (what a request asks for), `SamplingDefaults` (what a model asks for when the
request does not), `SamplerState` (one sequence's prompt, output and penalty books) and `sample()`
(a step's logits → token ids, their log-probs and the most likely alternatives, `Sampled`).

The pipeline, as tensor ops over the step's rows (vLLM's order; a stage runs only when some row
needs it, so plain requests pay for none of them):

1. ``logit_bias`` added; the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) masked
   while the output is shorter than ``min_tokens``; then the grammar's mask (structured outputs,
   `engine.grammar.mask_logits`: what the grammar does not allow next at -inf);
2. repetition penalty (transformers' definition: over prompt and output tokens, a positive logit
   divided by it, a negative one multiplied), then frequency and presence penalties (OpenAI's:
   ``logit - count * frequency - (count > 0) * presence`` over the output tokens);
3. greedy rows (``temperature == 0``) take the argmax here; the others are divided by their
   temperature, then min-p (tokens below ``min_p`` times the top probability), top-k (ties with the
   k-th kept), top-p (the smallest head whose mass reaches ``top_p``) remove tokens, and a token is
   drawn from the softmax of what is left (``torch.multinomial``: one batched draw for the unseeded
   rows, one per seeded row from its own generator).

Invariants: a request with a ``seed`` draws token ``t`` with a generator seeded from
``(seed, t)``, so its text depends only on the seed, not on the batch it ran in nor on which
process sampled which token (token 0 on a prefill replica, the rest on a decode replica gives the
same text as colocated); a decode replica rebuilds a state from the prompt and the tokens so far
(a grammar's matcher too, by replaying them). Greedy rows take the argmax of the masked logits.
The log-probabilities returned (the chosen token's and the ``top_logprobs`` most likely) are of the
*unmodified* distribution (no bias, penalty, temperature or truncation), as OpenAI's API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.grammar import GrammarError, GrammarMatcher, GrammarSpec, GrammarVocab, compile_grammar, mask_logits

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-prob), the most likely first
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (validated at construction)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # the most likely alternatives to report with each token (needs logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100)
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # structured outputs: the output must match it

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Whether the frequency / presence penalties need the output's token counts."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def is_stop(self, token_id: int, eos_ids: Sequence[int]) -> bool:
        """Whether ``token_id`` ends the sequence: a stop id, or EOS unless ``ignore_eos``."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_ids)


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling settings (its ``generation_config.json``), for requests that set none.

    None: the model says nothing, and the API's default applies.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,  # raises if out of range
                       top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
                       min_p=0.0 if self.min_p is None else self.min_p,
                       repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)


@dataclass
class SamplerState:
    """One sequence's sampler state: its prompt, the tokens sampled so far and penalty books.

    ``output_ids[t]`` is token ``t``; the next token is drawn with the generator of step
    ``len(output_ids)``. The books (``[V]`` tensors) are built on first use from the ids, then kept
    up to date as tokens are recorded.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    min_tokens_mask_ids: tuple[int, ...] = ()  # masked while len(output_ids) < min_tokens
    _seen: torch.Tensor | None = None  # [V] bool: in the prompt or the output (repetition penalty)
    _counts: torch.Tensor | None = None  # [V] fp32: occurrences in the output (frequency / presence)
    grammar: GrammarMatcher | None = None  # with ``params.grammar``: where the output stands in it

    @classmethod
    def new(cls, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
            eos_ids: Sequence[int] = (), vocab: GrammarVocab | None = None) -> SamplerState:
        """``output_ids``: tokens already sampled elsewhere (token 0 on a prefill replica).
        ``vocab``: the model's grammar vocabulary, needed when ``params.grammar`` is set; raises
        `GrammarError` when the grammar does not compile or rejects ``output_ids``."""
        stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_ids))
        matcher = None
        if params.grammar is not None:
            if vocab is None:
                raise GrammarError("a request with a grammar needs the model's grammar vocabulary")
            matcher = GrammarMatcher(compile_grammar(vocab, params.grammar), list(output_ids))
            if matcher.error is not None:
                raise GrammarError(matcher.error)
        return cls(params, prompt_ids, list(output_ids), tuple(dict.fromkeys(stops)), grammar=matcher)

    @property
    def step(self) -> int:
        return len(self.output_ids)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.params.seed is None or self.params.greedy:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.params.seed * 1_000_003 + self.step) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

    def seen(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._seen is None:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [*self.prompt_ids, *self.output_ids]
            if ids:
                self._seen[torch.tensor(ids, device=device)] = True
        return self._seen

    def counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if self.output_ids:
                ids = torch.tensor(self.output_ids, device=device)
                self._counts.index_put_((ids,), torch.ones(len(ids), device=device), accumulate=True)
        return self._counts

    def record(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self._seen is not None:
            self._seen[token_id] = True
        if self._counts is not None:
            self._counts[token_id] += 1
        if self.grammar is not None:
            self.grammar.advance(token_id)


def bias_and_min_tokens(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """logits: [B, V] → a copy with the biases added and, below min_tokens, the stop ids at -inf.

    Ids past the logits' width (a tokenizer larger than the model's head) have no logit to move."""
    V = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, st in enumerate(states):
        for tid, bias in st.params.logit_bias:
            if tid < V:
                rows.append(i)
                cols.append(tid)
                vals.append(bias)
        if st.step < st.params.min_tokens:
            for tid in st.min_tokens_mask_ids:
                if tid < V:
                    rows.append(i)
                    cols.append(tid)
                    vals.append(float("-inf"))
    if not rows:
        return logits
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(vals, device=dev), accumulate=True)


def penalties(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """logits: [B, V] → repetition, then frequency and presence penalties, for the rows that ask."""
    V = logits.shape[1]
    dev = logits.device
    rep = [i for i, st in enumerate(states) if st.params.repetition_penalty != 1.0]
    if rep:
        seen = torch.stack([states[i].seen(V, dev) for i in rep])  # [b, V]
        p = torch.tensor([states[i].params.repetition_penalty for i in rep], device=dev).unsqueeze(1)
        rows = logits[rep]  # [b, V]
        penalized = torch.where(rows < 0, rows * p, rows / p)
        logits = logits.index_copy(0, torch.tensor(rep, device=dev), torch.where(seen, penalized, rows))
    cnt = [i for i, st in enumerate(states) if st.params.counts_output]
    if cnt:
        counts = torch.stack([states[i].counts(V, dev) for i in cnt])  # [b, V]
        freq = torch.tensor([states[i].params.frequency_penalty for i in cnt], device=dev).unsqueeze(1)
        pres = torch.tensor([states[i].params.presence_penalty for i in cnt], device=dev).unsqueeze(1)
        rows = logits[cnt] - counts * freq - (counts > 0).float() * pres
        logits = logits.index_copy(0, torch.tensor(cnt, device=dev), rows)
    return logits


def truncate(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """x: [B, V] temperature-scaled logits → min-p, top-k, top-p applied (removed tokens at -inf)."""
    V = x.shape[1]
    dev = x.device
    if any(p.min_p > 0 for p in params):
        probs = x.softmax(-1)
        min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(k < V for k in ks):
        k = torch.tensor(ks, device=dev).unsqueeze(1)  # [B, 1]
        top = torch.topk(x, max(ks), dim=-1).values  # [B, kmax], descending
        kth = top.gather(1, k - 1)  # [B, 1]: ties with the k-th are kept, as transformers keeps them
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        x = _top_p(x, torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1))
    return x


TOP_P_HEADS = (256, 2048, 16384)  # top-p looks for the nucleus among this many tokens first, in turn
# (a full sort of a 50k-token row costs several times a top-k of a few thousand)


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: [B, V], top_p: [B, 1] → the smallest head of each row whose mass reaches its top_p; rows
    at 1.0 untouched. A token is dropped when the mass strictly before it already reaches top_p."""
    every = top_p >= 1.0  # [B, 1]
    lse = x.logsumexp(-1, keepdim=True)  # [B, 1]
    for k in TOP_P_HEADS:
        if k >= x.shape[1]:
            break
        vals, order = torch.topk(x, k, dim=-1)  # [B, k], descending
        probs = (vals - lse).exp()  # each head token's share of the whole row
        cum = probs.cumsum(-1)
        if bool(((cum[:, -1:] >= top_p) | every).all()):
            break
    else:
        k = x.shape[1]
    if k >= x.shape[1]:  # a nucleus reaches past every head: sort it all
        vals, order = torch.sort(x, dim=-1, descending=True)
        probs = vals.softmax(-1)
        cum = probs.cumsum(-1)
    kept = vals.masked_fill((cum - probs) >= top_p, float("-inf"))
    head = torch.full_like(x, float("-inf")).scatter(1, order, kept)
    return torch.where(every, x, head)


def _draw(probs: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """probs: [B, V] → one token per row [B], drawn among each row's candidates (its tokens of
    non-zero probability) only: a draw costs per candidate, and top-k / top-p / min-p leave few of a
    vocabulary. A seeded row draws from its own generator over its candidates in token-id order (one
    row at a time, so its draw depends on nothing else in the batch); the other rows in one batched
    draw over the batch's widest candidate set."""
    gens = [st.generator(probs.device) for st in states]
    free = [i for i, g in enumerate(gens) if g is None]
    out = torch.empty(len(states), dtype=torch.long, device=probs.device)
    if free:
        rows = probs if len(free) == len(states) else probs[free]  # [b, V]
        n = int((rows > 0).sum(-1).max())
        if n < rows.shape[1]:
            vals, idx = torch.topk(rows, n, dim=-1)  # [b, n]: every candidate of every row
            out[free] = idx.gather(1, torch.multinomial(vals, 1)).squeeze(1)
        else:
            out[free] = torch.multinomial(rows, 1).squeeze(1)
    for i, g in enumerate(gens):
        if g is not None:
            cand = probs[i].nonzero().squeeze(1)  # [n] ascending token ids
            out[i] = cand[torch.multinomial(probs[i, cand], 1, generator=g)[0]]
    return out


class Sampled(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # of the chosen tokens, under the unmodified distribution
    top: list[TopLogprobs]  # per row, its params' top_logprobs most likely tokens (() for none)


def _top(raw: torch.Tensor, lse: torch.Tensor, states: Sequence[SamplerState]) -> list[TopLogprobs]:
    """raw: [B, V] unmodified logits, lse: [B] their logsumexp → each row's most likely tokens."""
    ks = [st.params.top_logprobs for st in states]
    if not any(ks):
        return [() for _ in states]
    vals, idx = torch.topk(raw, max(ks), dim=-1)  # [B, kmax]
    lps, ids = (vals - lse.unsqueeze(1)).tolist(), idx.tolist()
    return [tuple(zip(ids[i][:k], lps[i][:k], strict=True)) for i, k in enumerate(ks)]


def sample(logits: torch.Tensor, states: list[SamplerState]) -> Sampled:
    """logits: [B, V], one row per state → the chosen tokens, their log-probs and the top alternatives.

    Records each chosen token in its state.
    """
    raw = logits.float()  # [B, V]
    params = [st.params for st in states]
    x = raw
    if any(p.logit_bias or st.step < p.min_tokens for p, st in zip(params, states, strict=True)):
        x = bias_and_min_tokens(x, states)
    if any(st.grammar is not None for st in states):
        x = mask_logits(x, [st.grammar for st in states])
    if any(p.repetition_penalty != 1.0 or p.counts_output for p in params):
        x = penalties(x, states)
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if not hot:
        ids = x.argmax(dim=-1)  # [B]
    else:
        every = len(hot) == len(states)
        sub = states if every else [states[i] for i in hot]
        temps = torch.tensor([st.params.temperature for st in sub], device=x.device).unsqueeze(1)
        y = truncate((x if every else x[hot]) / temps, [st.params for st in sub])  # [b, V]
        drawn = _draw(y.softmax(-1), sub)  # [b]
        ids = drawn if every else x.argmax(dim=-1).index_copy(0, torch.tensor(hot, device=x.device), drawn)
    lse = raw.logsumexp(dim=-1)  # [B]
    chosen = raw.gather(1, ids.unsqueeze(1)).squeeze(1) - lse  # [B]
    out = ids.tolist()
    for st, tok in zip(states, out, strict=True):
        st.record(tok)
    return Sampled(out, chosen.tolist(), _top(raw, lse, states))
