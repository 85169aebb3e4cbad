"""Our forward over the paged cache, through every attention backend, vs transformers' forward on the
same tiny random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import DecodeSeq, PrefillChunk
from tests.support.models import make_tiny

ATOL = 1e-4

FAMILIES = {
    "llama": {},
    "qwen2": {},
    "llama-tied": {"tie_word_embeddings": True},
    "qwen3": {},
    "phi3-window": {"sliding_window": 16},
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "qwen3-yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    "mistral-window": {"sliding_window": 16},
    "qwen2-window": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    "qwen3-window": {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1},
    # local / global layers alternating, window 16; attention and final soft-caps 5 and 3 (`make_tiny`)
    "gemma2": {},
    "gemma3": {},
    # the global layers' RoPE scaled, the local ones' not; head size 64: the C++ prefill attention
    "gemma3-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "head_dim": 64},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


#: every attention backend (`engine.attention.registry`) against the same oracle
BACKENDS = ("reference", "cpu", "torch")
#: greedy tokens `test_generate_matches_hf_greedy` compares per backend, each past every family's window (the
#: prompt is 12 tokens): eager flex (the torch backend on a CPU) costs a dispatch per layer and step, so it
#: decodes fewer; every other test runs the same sizes on every backend
GREEDY_TOKENS = {"reference": 48, "cpu": 48, "torch": 16}


class Oracle:
    """One family's tiny model on disk and transformers over it; each answer computed once and shared by
    every backend's tests (they ask for the same ids)."""

    def __init__(self, name: str, root: Path) -> None:
        import transformers

        family = next((f for f in ("qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3") if name.startswith(f)),
                      "llama")
        self.path = make_tiny(family, root, **FAMILIES[name])
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._logits:
            with torch.no_grad():
                self._logits[key] = self.hf(torch.tensor([ids])).logits[0].float()  # [S, V]
        return self._logits[key]

    def greedy(self, ids: list[int], new: int) -> list[int]:
        key = (tuple(ids), new)
        if key not in self._greedy:
            with torch.no_grad():
                out = self.hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)  # [1, S + new]
            self._greedy[key] = out[0, len(ids):].tolist()
        return self._greedy[key]


@pytest.fixture(scope="module")
def oracles() -> dict[str, Oracle]:
    """The families' oracles built so far (each on first use)."""
    return {}


@pytest.fixture(scope="module", params=[f"{name}/{b}" for name in sorted(FAMILIES) for b in BACKENDS])
def pair(request: pytest.FixtureRequest, oracles: dict[str, Oracle],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Oracle, Engine]:
    name, backend = request.param.split("/")
    if name not in oracles:
        oracles[name] = Oracle(name, tmp_path_factory.mktemp(name))
    oracle = oracles[name]
    eng = Engine.from_dir(oracle.path, EngineConfig(num_blocks=128, block_size=8, enable_prefix_cache=True,
                                                    backend=backend))
    assert eng.runner.model.attention.name == backend
    return oracle, eng


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("n", [1, 7, 8, 33, 100])
def test_prefill_matches(pair, n: int) -> None:
    oracle, eng = pair
    ids = rand_ids(n, n)
    blocks = eng.pool.allocate(eng.blocks_for(n))
    try:
        ours = eng.runner.prefill([PrefillChunk(ids, 0, blocks)], all_logits=True)
    finally:
        eng.pool.free(blocks)
    torch.testing.assert_close(ours, oracle.logits(ids), atol=ATOL, rtol=0)


def test_batched_prefill_matches(pair) -> None:
    oracle, eng = pair
    prompts = [rand_ids(n, 100 + n) for n in (5, 17, 40)]
    tables = [eng.pool.allocate(eng.blocks_for(len(p))) for p in prompts]
    try:
        ours = eng.runner.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    finally:
        for t in tables:
            eng.pool.free(t)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(ours[i], oracle.logits(p)[-1], atol=ATOL, rtol=0)


def test_three_chunks_match(pair) -> None:
    oracle, eng = pair
    ids = rand_ids(50, 7)
    blocks = eng.pool.allocate(eng.blocks_for(50))
    try:
        parts = []
        for lo, hi in ((0, 13), (13, 29), (29, 50)):
            parts.append(eng.runner.prefill([PrefillChunk(ids[lo:hi], lo, blocks)], all_logits=True))
    finally:
        eng.pool.free(blocks)
    torch.testing.assert_close(torch.cat(parts), oracle.logits(ids), atol=ATOL, rtol=0)


def test_prefix_cache_hit_matches(pair) -> None:
    oracle, eng = pair
    prefix = rand_ids(24, 11)  # 3 full blocks of 8
    a, b = [*prefix, *rand_ids(5, 12)], [*prefix, *rand_ids(9, 13)]
    pool = eng.pool
    ta = pool.allocate(eng.blocks_for(len(a)))
    eng.runner.prefill([PrefillChunk(a, 0, ta)])
    pool.commit_full_blocks(ta, a)
    hit = pool.match_prefix(b[:-1])
    assert hit == ta[:3], "the three full prefix blocks are reused"
    tb = hit + pool.allocate(eng.blocks_for(len(b)) - len(hit))
    try:
        cached = len(hit) * eng.block_size
        ours = eng.runner.prefill([PrefillChunk(b[cached:], cached, tb)], all_logits=True)
    finally:
        pool.free(ta)
        pool.free(tb)
    torch.testing.assert_close(ours, oracle.logits(b)[24:], atol=ATOL, rtol=0)
    pool.check_integrity()


def test_batched_decode_matches(pair) -> None:
    """4 sequences of different lengths, 3 decode steps each, against full forwards."""
    oracle, eng = pair
    seqs = [rand_ids(n, 200 + n) for n in (3, 8, 21, 60)]
    steps = 3
    tables = [eng.pool.allocate(eng.blocks_for(len(s) + steps)) for s in seqs]
    try:
        logits = eng.runner.prefill([PrefillChunk(s, 0, t) for s, t in zip(seqs, tables, strict=True)])
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            batch = [DecodeSeq(tok, len(s), t) for tok, s, t in zip(nxt, seqs, tables, strict=True)]
            for s, tok in zip(seqs, nxt, strict=True):
                s.append(tok)
            logits = eng.runner.decode(batch)
            for i, s in enumerate(seqs):
                torch.testing.assert_close(logits[i], oracle.logits(s)[-1], atol=ATOL, rtol=0)
    finally:
        for t in tables:
            eng.pool.free(t)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_generate_matches_hf_greedy(pair) -> None:
    from engine.generate import generate
    from engine.sampling.sampler import SamplingParams

    oracle, eng = pair
    ids = rand_ids(12, 99)
    new = GREEDY_TOKENS[eng.runner.model.attention.name]
    out = generate(eng, ids, SamplingParams(max_tokens=new, ignore_eos=True), eos_token_ids=())
    assert out.token_ids == oracle.greedy(ids, new)


def test_bad_input_errors(tmp_path: Path) -> None:
    import json

    from engine.errors import ContextLengthError, ModelLoadError

    path = make_tiny("llama", tmp_path / "m")
    # the reference backend: the errors below come before any backend, and it loads without timing kernels
    eng = Engine.from_dir(path, EngineConfig(num_blocks=8, block_size=8, backend="reference"))
    with pytest.raises(ContextLengthError, match="maximum context length is 1024"):
        eng.check_length(1000, 100)
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"],
                                                  "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine.from_dir(bad, EngineConfig())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 96}))
    (bad / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: config does not match weights"):
        Engine.from_dir(bad, EngineConfig())
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read"):
        Engine.from_dir(bad, EngineConfig())
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        Engine.from_dir(bad, EngineConfig())


def test_group_by_length() -> None:
    from engine.attention.cpu_decode import group_by_length

    assert group_by_length([4]) == [(0, 1)]
    assert group_by_length([2, 2, 3, 4]) == [(0, 4)]
    assert group_by_length([1, 2, 3, 8]) == [(0, 2), (2, 3), (3, 4)]
    assert group_by_length([1, 3, 7, 15, 31, 63], max_groups=3) == [(0, 1), (1, 2), (2, 6)]


def test_warm_up_leaves_pool_and_prefix_cache_untouched(pair) -> None:
    """The start-up forward takes blocks and gives them back; no block is hashed; answers still match."""
    oracle, eng = pair
    free_before = eng.pool.num_free_blocks
    zeros = [0] * 64  # what warm_up feeds: a cached prefix of zeros would be a lie
    assert eng.warm_up(64) == 64
    assert eng.pool.num_free_blocks == free_before
    assert eng.pool.match_prefix(zeros) == []
    eng.pool.check_integrity()
    capped = eng.warm_up(10**6)  # never past max_model_len or the free blocks
    assert capped == min(eng.max_model_len, free_before * eng.block_size)
    ids = rand_ids(20, 3)
    blocks = eng.pool.allocate(eng.blocks_for(20))
    try:
        ours = eng.runner.prefill([PrefillChunk(ids, 0, blocks)], all_logits=True)
    finally:
        eng.pool.free(blocks)
    torch.testing.assert_close(ours, oracle.logits(ids), atol=ATOL, rtol=0)
