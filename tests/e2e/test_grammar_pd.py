"""Structured outputs across the pools: token 0 sampled under the grammar on the prefill worker, the
matcher rebuilt from it on the decode worker, and colocated, all equal to the reference `generate()`
and valid under `jsonschema`, in one batch with requests that have no grammar; a token the grammar
rejects (a mask that failed, injected) ends only its own stream, with an error and without the token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from decode_worker.types import DecodeChoice, DecodeRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling import sampler as sampling
from engine.sampling.grammar import GrammarError, GrammarSpec
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from prefill_worker.types import PrefillRequest
from tests.support.inprocess_pd import EOS, collect, make_colocated, make_pd, run_both_modes
from tests.support.models import make_tiny_chat_model

pytestmark = pytest.mark.timeout(240)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ann", "bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
PARAMS = [
    SamplingParams(max_tokens=60, grammar=SPEC),
    SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=SPEC),
    SamplingParams(max_tokens=60, temperature=0.8, top_k=40, seed=6, grammar=GrammarSpec("json_object")),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7),  # no grammar, same batch
]


@pytest.fixture(scope="module")
def chat_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-grammar-pd"), seed=13)


@pytest.fixture(scope="module")
def prompts(chat_path: Path) -> list[tuple[int, ...]]:
    tok = Tokenizer.from_dir(chat_path)
    return [tuple(tok.encode_chat([{"role": "user", "content": f"Describe person {i} as JSON."}]))
            for i in range(len(PARAMS))]


async def test_both_modes_match_the_reference_and_validate(chat_path: Path, prompts: list[tuple[int, ...]]) -> None:
    ref = Engine.from_dir(chat_path, EngineConfig(num_blocks=64, block_size=16))
    want = [generate(ref, p, s, eos_token_ids=(EOS,)) for p, s in zip(prompts, PARAMS, strict=True)]
    tok = Tokenizer.from_dir(chat_path)
    for out, params in zip(want, PARAMS, strict=True):
        if params.grammar == SPEC:  # (a random model's free-form json_object runs to max_tokens)
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(tok.decode(out.token_ids)), SCHEMA)
    got, got_colo = await run_both_modes(chat_path, prompts, PARAMS, chunk=16)
    assert got == got_colo == [(w.token_ids, w.finish_reason) for w in want]


async def test_a_rejected_token_ends_only_its_stream_with_an_error(chat_path: Path, prompts: list[tuple[int, ...]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "mask_logits", lambda x, matchers: x)  # a mask that lets anything through
    plain = PARAMS[-1]
    ref = Engine.from_dir(chat_path, EngineConfig(num_blocks=64, block_size=16))
    want_plain = generate(ref, prompts[1], plain, eos_token_ids=(EOS,)).token_ids
    colo = make_colocated(chat_path, chunk=16)
    pd = make_pd(chat_path)
    for w in (colo, pd.prefill):
        await w.start()
    try:
        bad, good = await asyncio.gather(collect(colo, DecodeRequest("g", prompts[0], PARAMS[0])),
                                         collect(colo, DecodeRequest("p", prompts[1], plain)))
        assert bad[0] == [] and bad[1] == "error" and bad[2] is not None and "rejected" in bad[2]
        assert good[0] == want_plain
        with pytest.raises(GrammarError, match="rejected"):
            await pd.prefill.prefill(PrefillRequest("pg", prompts[0], PARAMS[0]))
        x = Tokenizer.from_dir(chat_path).encode("x")[0]
        with pytest.raises(GrammarError, match="rejected"):  # a sampler state rebuilt from a token it rejects
            await colo.generate(DecodeRequest("dg", prompts[0], PARAMS[0], choices=(DecodeChoice(0, x),))).__anext__()
        assert not colo.streams and pd.prefill.engine.pool.num_free_blocks == pd.prefill.engine.pool.num_blocks
    finally:
        for w in (pd.prefill, colo):
            await w.stop()
