"""Structured outputs in the engine: the grammar mask against an independent oracle (a regular
expression of the schema's language, matched partially over the real SmolLM2 tokenizer's token
texts), sampling under a schema against `jsonschema`, and matchers rebuilt from the tokens so far
against the live one."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import regex
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.grammar import (
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarVocab,
    allowed_tokens,
    compile_grammar,
    grammar_vocab,
    mask_logits,
)
from engine.sampling.sampler import SamplerState, SamplingParams, sample
from engine.tokenizer import Tokenizer
from tests.support.grammar_specs import SCHEMA, SPEC
from tests.support.models import make_tiny_chat_model

pytestmark = pytest.mark.timeout(120)

# The same language written out: properties in the schema's order, ", " and ": " as separators.
SCHEMA_RE = regex.compile(r'\{"color": "(red|green|light blue)", "n": ([0-9]|[1-9][0-9]), "ok": (true|false)\}')


@pytest.fixture(scope="module")
def tok(smollm_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def vocab(smollm_dir: Path, tok: Tokenizer) -> GrammarVocab:
    return grammar_vocab(smollm_dir, tok.eos_token_ids)


@pytest.fixture(scope="module")
def texts(tok: Tokenizer, vocab: GrammarVocab) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in range(vocab.size)]


def allowed_set(m: GrammarMatcher, width: int) -> set[int]:
    return set(np.nonzero(allowed_tokens([m], width)[0])[0].tolist())


@pytest.mark.parametrize(("kind", "source", "why"), [
    ("regex", "", "kind"), ("json_object", "{}", "no source"), ("json_schema", "{nope", "must be JSON"),
    ("json_schema", "[1]", "JSON object")])
def test_spec_is_validated(kind: str, source: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        GrammarSpec(kind, source)


def test_spec_pickles_inside_sampling_params() -> None:
    params = SamplingParams(max_tokens=8, grammar=SPEC)
    assert pickle.loads(pickle.dumps(params)) == params


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "object", "properties": {"a": {"type": "foo"}}}, "foo"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around")])
def test_a_schema_llguidance_cannot_compile_raises_naming_why(vocab: GrammarVocab, schema: dict, why: str) -> None:
    with pytest.raises(GrammarError, match=why):
        compile_grammar(vocab, GrammarSpec("json_schema", json.dumps(schema)))


def test_compiled_grammars_are_cached_per_spec(vocab: GrammarVocab) -> None:
    assert compile_grammar(vocab, SPEC) is compile_grammar(vocab, GrammarSpec("json_schema", json.dumps(SCHEMA)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mask_allows_only_tokens_that_keep_a_valid_prefix(vocab: GrammarVocab, texts: list[str],
                                                          tok: Tokenizer, seed: int) -> None:
    """Random walks through the mask: every allowed token keeps the text a prefix of the schema's
    language, EOS is allowed exactly where the text is complete, and every choice point offers
    more than one way on (the enum values, the digits, true / false)."""
    rng = random.Random(seed)
    m = GrammarMatcher(compile_grammar(vocab, SPEC))
    out, branches = "", 0
    while m.live:
        allowed = allowed_set(m, vocab.size)
        assert allowed
        complete = SCHEMA_RE.fullmatch(out) is not None
        assert (set(tok.eos_token_ids) <= allowed) == complete
        assert all(SCHEMA_RE.fullmatch(out + texts[t], partial=True) for t in allowed - set(tok.eos_token_ids))
        branches += len(allowed) > 1
        t = rng.choice(sorted(allowed))
        m.advance(t)
        out += texts[t]
    assert m.done and SCHEMA_RE.fullmatch(out) and branches >= 3
    jsonschema.validate(json.loads(out), SCHEMA)


def test_rejected_token_is_an_error_not_an_exception(vocab: GrammarVocab, tok: Tokenizer) -> None:
    m = GrammarMatcher(compile_grammar(vocab, SPEC))
    m.advance(tok.encode("hello")[0])
    assert m.error is not None and "rejected" in m.error and not m.live and not m.done
    with pytest.raises(GrammarError, match="rejected"):  # replaying such tokens elsewhere raises
        SamplerState.new(SamplingParams(grammar=SPEC), (), tok.encode("hello"), tok.eos_token_ids, vocab)


def test_rebuilt_matcher_equals_the_live_one(vocab: GrammarVocab) -> None:
    compiled = compile_grammar(vocab, GrammarSpec("json_object"))
    rng = random.Random(5)
    live, seen = GrammarMatcher(compiled), []
    for _ in range(40):
        if not live.live:
            break
        allowed = sorted(allowed_set(live, vocab.size))
        t = rng.choice(allowed)
        live.advance(t)
        seen.append(t)
        assert GrammarMatcher(compiled, seen).state() == live.state()
    assert len(seen) >= 10


def test_mask_stage_leaves_other_rows_and_masks_ids_past_the_vocabulary(vocab: GrammarVocab) -> None:
    width = vocab.size + 64  # a model head wider than its tokenizer
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0))  # [B, V]
    m = GrammarMatcher(compile_grammar(vocab, SPEC))
    y = mask_logits(x, [None, m, None])
    torch.testing.assert_close(y[[0, 2]], x[[0, 2]])
    allowed = torch.from_numpy(allowed_tokens([m], width)[0])
    assert torch.isfinite(y[1]).eq(allowed).all() and not allowed[vocab.size:].any()
    torch.testing.assert_close(y[1][allowed], x[1][allowed])
    assert mask_logits(x, [None, None, None]) is x


def test_sample_keeps_unmodified_logprobs_and_greedy_takes_the_masked_argmax(vocab: GrammarVocab) -> None:
    x = torch.randn(2, vocab.size, generator=torch.Generator().manual_seed(1))  # [B, V]
    states = [SamplerState.new(SamplingParams(grammar=SPEC), vocab=vocab), SamplerState.new(SamplingParams())]
    allowed = torch.from_numpy(allowed_tokens([GrammarMatcher(compile_grammar(vocab, SPEC))], vocab.size)[0])
    out = sample(x, states)
    assert out.token_ids == [int(x[0].masked_fill(~allowed, float("-inf")).argmax()), int(x[1].argmax())]
    want = torch.log_softmax(x, -1)[[0, 1], out.token_ids]
    torch.testing.assert_close(torch.tensor(out.logprobs), want)
    assert states[0].grammar is not None and states[0].grammar.state() != GrammarMatcher(
        compile_grammar(vocab, SPEC)).state()  # record() advanced the matcher


def test_min_tokens_holds_eos_back_under_a_grammar(vocab: GrammarVocab, tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    x = torch.zeros(1, vocab.size)  # [1, V]
    x[0, eos] = float("-inf")  # what min_tokens did to the stop id
    m = GrammarMatcher(compile_grammar(vocab, GrammarSpec("json_schema", json.dumps({"type": "integer"}))),
                       tok.encode("7"))
    y = mask_logits(x, [m])
    finite = set(torch.isfinite(y[0]).nonzero().squeeze(1).tolist())
    assert finite == allowed_set(m, vocab.size) - {eos}  # digits stay; EOS stays held back by min_tokens


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-grammar"), seed=11)
    return Engine.from_dir(path, EngineConfig(num_blocks=64, block_size=16))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=60, grammar=SPEC),
    SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=SPEC),
    SamplingParams(max_tokens=60, temperature=0.7, top_p=0.9, seed=4, grammar=SPEC)],
    ids=["greedy", "seeded", "seeded_top_p"])
def test_generation_under_a_schema_parses_and_validates(tiny_chat: Engine, params: SamplingParams) -> None:
    tok = Tokenizer.from_dir(tiny_chat.model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "A color, please."}])
    out = generate(tiny_chat, prompt, params, tok.eos_token_ids)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(out.token_ids)), SCHEMA)
    again = generate(tiny_chat, prompt, params, tok.eos_token_ids)
    assert again.token_ids == out.token_ids  # greedy / seeded: the same text each time


def test_a_tokenizer_llguidance_cannot_read_is_a_grammar_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unknown"}}))
    with pytest.raises(GrammarError, match=r"tokenizer\.json"):
        grammar_vocab(tmp_path, (2,))
