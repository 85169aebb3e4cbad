"""Structured outputs: a request's grammar, compiled against the model's tokenizer by llguidance,
one matcher per sequence, and the batched mask over a step's logits.

Owns:
- `GrammarSpec`: what a request constrains its output to (``json_object``: any JSON object;
  ``json_schema``: ``source`` is the schema's JSON text), validated at construction. A frozen value
  of strings: it crosses the Ray boundary inside `SamplingParams` (pickled with the prefill and
  decode requests) and keys the compile cache.
- `GrammarVocab` / `grammar_vocab`: llguidance's view of one model's tokenizer (its
  ``tokenizer.json`` and the EOS ids). Building one takes a noticeable fraction of a second, so a
  process keeps one per (folder, EOS ids).
- `compile_grammar`: a spec → a `CompiledGrammar` (a matcher at position 0, copied for each
  sequence), cached per (vocab, spec); what llguidance cannot compile raises `GrammarError`.
- `load_grammar`: both of the above off the event loop, for the workers before they admit a request.
- `GrammarMatcher`: one sequence's place in its grammar, advanced token by token by
  `engine.sampling.sampler.SamplerState.record`; a process that did not sample the tokens so far (the
  decode replica after token 0 on a prefill replica) rebuilds it by replaying them.
- `mask_logits`: the grammar stage of `engine.sampling.sampler.sample`: in every row with a live matcher,
  the tokens the grammar does not allow next (and ids past the tokenizer's vocabulary) go to -inf.
  Rows without a grammar are untouched, and a step with none never enters the stage.

Invariants: a matcher never raises on a token: a rejected token puts it in error (``error`` says
why), and the worker ends the stream with that error instead of emitting the token. ``done`` (the
grammar allows nothing more) ends the sequence with finish reason ``stop``, ``min_tokens`` or not.
EOS is in the mask only where the grammar accepts the output so far. JSON is written with ``", "``
between items and ``": "`` after keys and no other whitespace (a schema's ``x-guidance`` may say
otherwise), so a model cannot pad its answer with whitespace until ``max_tokens``.

llguidance is imported where a grammar is first built (`grammar_vocab`, `compile_grammar`): the
sampler imports this module, and a process that never sees a grammar runs without the package.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.device_copy import send
from engine.errors import missing_dependency

if TYPE_CHECKING:
    import llguidance as llg
    from llguidance._lib import JsonCompileOptions

#: what a missing llguidance is needed for, in `missing_dependency`'s error
_NEEDED_FOR = "a structured-output grammar (response_format)"

GRAMMAR_KINDS = ("json_object", "json_schema")
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A grammar llguidance cannot compile, or tokens it does not accept."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``source``: the JSON Schema text (``json_schema``),
    empty for ``json_object``."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.source:
                raise ValueError("a json_object grammar takes no source")
            return
        try:
            schema = json.loads(self.source)
        except ValueError as e:
            raise ValueError(f"a json_schema grammar's source must be JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("a json_schema grammar's source must be a JSON object")

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (not yet checked: `compile_grammar` checks)."""
        with missing_dependency("llguidance", _NEEDED_FOR):
            import llguidance as llg
        return llg.LLMatcher.grammar_from_json_schema(
            _ANY_OBJECT if self.kind == "json_object" else self.source, defaults=_JSON_OPTIONS)


@dataclass(frozen=True, eq=False)  # compared by identity: one per process and tokenizer
class GrammarVocab:
    """llguidance's tokenizer for one model; ``size``: the ids it knows (a mask's width)."""

    tokenizer: llg.LLTokenizer

    @property
    def size(self) -> int:
        return int(self.tokenizer.vocab_size)


def grammar_vocab(folder: str | Path, eos_ids: Sequence[int]) -> GrammarVocab:
    """The model folder's ``tokenizer.json`` (what `engine.tokenizer.Tokenizer` reads) as llguidance's
    tokenizer, with ``eos_ids`` as the tokens that end an accepted output; one per process."""
    return _vocab(str(Path(folder).resolve()), tuple(eos_ids))


@functools.lru_cache(maxsize=4)
def _vocab(folder: str, eos_ids: tuple[int, ...]) -> GrammarVocab:
    with missing_dependency("llguidance", _NEEDED_FOR):
        import llguidance as llg
    text = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
    try:
        return GrammarVocab(llg.LLTokenizer(text, eos_token=list(eos_ids) or None))
    except Exception as e:  # llguidance raises plain exceptions on a tokenizer it cannot read
        raise GrammarError(f"llguidance cannot use this model's tokenizer.json: {e}") from None


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one vocabulary: ``start`` is a matcher that has consumed nothing."""

    spec: GrammarSpec
    vocab: GrammarVocab
    start: llg.LLMatcher


def _brief(error: str) -> str:
    """llguidance's error text without the parser state it may append, on one line."""
    lines = [ln.strip() for ln in error.split("<state>")[0].splitlines() if ln.strip()]
    return " ".join(lines) or "rejected"


@functools.lru_cache(maxsize=256)
def compile_grammar(vocab: GrammarVocab, spec: GrammarSpec) -> CompiledGrammar:
    """Raises `GrammarError` naming what llguidance refuses (an unknown type, an unsupported keyword)."""
    try:
        grammar = spec.llguidance_grammar()
    except ValueError as e:
        raise GrammarError(str(e)) from None
    with missing_dependency("llguidance", _NEEDED_FOR):
        import llguidance as llg
    start = llg.LLMatcher(vocab.tokenizer, grammar, log_level=0)
    if start.is_error():
        raise GrammarError(_brief(start.get_error()))
    return CompiledGrammar(spec, vocab, start)


async def load_grammar(spec: GrammarSpec | None, folder: str | Path, eos_ids: Sequence[int]) -> GrammarVocab | None:
    """A worker's step before it builds a request's `SamplerState`: the vocabulary, with ``spec``
    compiled into the cache, both built in a thread so a slow build does not hold up the event loop
    (and the steps of every sequence in flight). None without a spec; raises `GrammarError`."""
    if spec is None:
        return None

    def build() -> GrammarVocab:
        vocab = grammar_vocab(folder, eos_ids)
        compile_grammar(vocab, spec)
        return vocab

    return await asyncio.to_thread(build)


class GrammarMatcher:
    """One sequence's position in its grammar. ``output_ids``: tokens already generated (replayed)."""

    def __init__(self, compiled: CompiledGrammar, output_ids: Sequence[int] = ()) -> None:
        self.vocab = compiled.vocab
        self._m = compiled.start.deep_copy()
        self.error: str | None = None
        for tok in output_ids:
            self.advance(tok)

    def advance(self, token_id: int) -> None:
        """Consume one sampled token; a token the grammar rejects sets ``error`` (never raises)."""
        if self.error is not None:
            return
        if not 0 <= token_id < self.vocab.size or not self._m.consume_token(token_id):
            self.error = f"the grammar rejected token {token_id}: {_brief(self._m.get_error())}"

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows no further token (EOS aside)."""
        return self.error is None and self._m.is_stopped()

    @property
    def live(self) -> bool:
        """Whether the next token is sampled under this grammar (neither failed nor complete)."""
        return self.error is None and not self._m.is_stopped()

    def state(self) -> tuple[bool, bool, bytes]:
        """(accepting, done, the next token's mask): two matchers in the same state agree on it."""
        return self._m.is_accepting(), self.done, bytes(self._m.compute_bitmask())

    def fill_mask(self, row: np.ndarray) -> None:
        """row: [(vocab.size + 31) // 32] int32, contiguous → bit t set iff token t may come next."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


def mask_words(matchers: list[GrammarMatcher]) -> np.ndarray:
    """→ [len(matchers), (vocab.size + 31) // 32] int32: bit ``t % 32`` of word ``t // 32`` set iff
    the row's matcher allows token ``t`` next. Row by row on the calling thread: a step waits on no
    other thread's wake-up."""
    words = (matchers[0].vocab.size + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)  # [b, words]
    for m, row in zip(matchers, bits, strict=True):
        m.fill_mask(row)
    return bits


def allowed_tokens(matchers: list[GrammarMatcher], width: int) -> np.ndarray:
    """→ [len(matchers), width] bool: which ids each matcher allows next (ids past its vocabulary: none)."""
    vocab = matchers[0].vocab
    bits = mask_words(matchers)  # [b, words]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=min(width, vocab.size), bitorder="little")
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    return allowed.astype(bool)


def mask_logits(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """logits: [B, V], one matcher (or None) per row → a copy with every live matcher's disallowed
    tokens at -inf. A live matcher allows some token other than EOS (one that allows nothing more is
    ``done``, and its sequence ends), so ``min_tokens`` holding EOS back never empties a row."""
    rows = [i for i, m in enumerate(matchers) if m is not None and m.live]
    if not rows:
        return logits
    live = [m for m in matchers if m is not None and m.live]
    allowed = send(torch.from_numpy(allowed_tokens(live, logits.shape[1])), logits.device)  # [b, V]
    if len(rows) == logits.shape[0]:  # every row under a grammar: no gather and scatter of rows
        return logits.masked_fill(~allowed, float("-inf"))
    index = send(torch.tensor(rows), logits.device)  # [b]
    sub = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))  # [b, V]
    return logits.index_copy(0, index, sub)
