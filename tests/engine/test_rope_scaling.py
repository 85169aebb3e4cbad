"""Length-dependent and partial RoPE against transformers on tiny random models: longrope (Phi-3),
longrope over the first 3/4 of each head (Phi-4-mini's partial rotary) and dynamic NTK (Llama).

transformers picks these tables per forward call from the call's length (`engine.model.rope_params`): the
prompts here are shorter than, as long as and longer than the threshold (32 tokens), and the decoding
crosses it, so every table is used, in one-shot, chunked and batched prefills, after a reused prefix
and in batched decode steps that mix sequences on both sides of it. Each engine path runs: the
native RoPE + store (and the one-call decode step), the eager fast path, the reference path and the
torch backend (FlexAttention over the paged cache, eager on a CPU: the code a GPU runs compiled).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.runner import DecodeSeq, PrefillChunk
from engine.sampling.sampler import SamplingParams
from tests.support.models import make_tiny

ATOL = 1e-4
THRESHOLD = 32  # longrope's original_max_position_embeddings, dynamic NTK's max_position_embeddings
PROMPTS = (20, 32, 45)  # below (crossed while decoding), at (the first decode step crosses) and above
NEW = 48  # decode positions compared per prompt


def _longrope(n: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(n)],
            "long_factor": [1.0 + 1.5 * i for i in range(n)]}


MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-longrope": ("phi3", {"rope_scaling": _longrope(8), "max_position_embeddings": 128,
                               "original_max_position_embeddings": THRESHOLD}),
    # Phi-4-mini: rotary over int(16 * 0.75) = 12 of each head's 16 dims, longrope over those
    "phi4-partial-longrope": ("phi3", {"rope_scaling": _longrope(6), "partial_rotary_factor": 0.75,
                                       "max_position_embeddings": 128,
                                       "original_max_position_embeddings": THRESHOLD}),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
                                "max_position_embeddings": THRESHOLD}),
}
#: cpu backend: native RoPE + store, or eager; the reference backend; the torch backend
PATHS = ("native", "eager", "reference", "torch")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family, overrides = MODELS[request.param]
    return request.param, make_tiny(family, tmp_path_factory.mktemp(request.param), seed=3, eos_token_id=None,
                                    **overrides)


@pytest.fixture(scope="module")
def hf(model_dir: tuple[str, Path]) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir[1], dtype=torch.float32).eval()


def engine(path: Path, mode: str) -> Engine:
    backend = mode if mode in ("reference", "torch") else "cpu"
    # eager flex reads every cache slot: the torch backend gets the blocks the three prompts need (31)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=32 if mode == "torch" else 64, block_size=8,
                                             backend=backend))
    assert eng.runner.model.attention.name == backend
    if mode == "eager":
        eng.runner.model.attention.native_rope, eng.runner.model.attention.native_step = False, None
    return eng


def fresh(hf: Any) -> Any:
    """transformers' dynamic NTK module keeps the longest call's table for later calls above its
    threshold; each oracle call here is a fresh generation's (its own length's table)."""
    rot = hf.model.rotary_emb
    rot.register_buffer("inv_freq", rot.original_inv_freq.clone(), persistent=False)
    rot.max_seq_len_cached = rot.original_max_seq_len
    return hf


def hf_logits(hf: Any, ids: Sequence[int]) -> torch.Tensor:
    """[S, V]: one forward over the whole prompt, as a generation's prefill."""
    with torch.no_grad():
        return fresh(hf)(torch.tensor([list(ids)])).logits[0].float()


def hf_generate(hf: Any, ids: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits [NEW, V] they were chosen from."""
    with torch.no_grad():
        out = fresh(hf).generate(torch.tensor([list(ids)]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_along(eng: Engine, prompts: list[list[int]], tables: list[list[int]],
                 refs: list[tuple[list[int], torch.Tensor]], first: torch.Tensor) -> None:
    """Decode every prompt in one batch per step, fed transformers' tokens: each step's logits and
    greedy choice must be transformers' (``first``: the prefill's last-row logits [B, V])."""
    logits = first
    for step in range(NEW):
        for i, (tokens, ref_logits) in enumerate(refs):
            torch.testing.assert_close(logits[i], ref_logits[step], atol=ATOL, rtol=0)
            assert int(logits[i].argmax()) == tokens[step], f"prompt {i}, step {step}"
        if step + 1 < NEW:
            seqs = [DecodeSeq(tokens[step], len(p) + step, t, history=[*p, *tokens[:step]])
                    for p, (tokens, _), t in zip(prompts, refs, tables, strict=True)]
            logits = eng.runner.decode(seqs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-shot", "chunked"])
def test_prefill_and_decode_match_transformers(model_dir: tuple[str, Path], hf: Any, path: str,
                                               chunked: bool) -> None:
    """All three prompts in one batched prefill (whole, or 13-token chunks interleaved as the workers
    run them), then decoded together: logits within 1e-4 of transformers, greedy tokens equal."""
    eng = engine(model_dir[1], path)
    prompts = [rand_ids(n, n) for n in PROMPTS]
    tables = [eng.pool.allocate(eng.blocks_for(n + NEW)) for n in PROMPTS]
    try:
        if not chunked:
            chunks = [PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
            out = eng.runner.prefill(chunks, all_logits=True)
            rows = torch.cumsum(torch.tensor([0, *PROMPTS]), 0).tolist()
            got = [out[rows[i] : rows[i + 1]] for i in range(len(PROMPTS))]
        else:
            got = [torch.empty(0)] * len(PROMPTS)
            for lo in range(0, max(PROMPTS), 13):
                live = [i for i, n in enumerate(PROMPTS) if lo < n]
                chunks = [PrefillChunk(prompts[i][lo : lo + 13], lo, tables[i], prompt_len=PROMPTS[i]) for i in live]
                out = eng.runner.prefill(chunks, all_logits=True)
                offset = 0
                for i, c in zip(live, chunks, strict=True):
                    got[i] = torch.cat([got[i], out[offset : offset + len(c.token_ids)]])
                    offset += len(c.token_ids)
        for p, g in zip(prompts, got, strict=True):
            torch.testing.assert_close(g, hf_logits(hf, p), atol=ATOL, rtol=0)
        decode_along(eng, prompts, tables, [hf_generate(hf, p) for p in prompts], torch.stack([g[-1] for g in got]))
    finally:
        for t in tables:
            eng.pool.free(t)
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


#: per model: which later prompt reuses which earlier one's cached prefix (by the RoPE table their
#: lengths choose), the prompts being a shared 16-token prefix plus 4, 8, 29 and 34 tokens (20, 24,
#: 45 and 50 in all)
REUSE = {"phi3-longrope": [None, 0, None, 2], "phi4-partial-longrope": [None, 0, None, 2],
         "llama-dynamic": [None, 0, None, None]}  # dynamic NTK: each length above 32 has its own table


@pytest.mark.parametrize("path", PATHS[:2])
def test_prefix_reuse_only_within_one_rope_table(model_dir: tuple[str, Path], hf: Any, path: str) -> None:
    name, model = model_dir
    eng = engine(model, path)
    prefix = rand_ids(16, 7)  # 2 full blocks of 8
    prompts = [[*prefix, *rand_ids(n, 100 + n)] for n in (4, 8, 29, 34)]
    pool, held = eng.pool, []
    try:
        for i, p in enumerate(prompts):
            salt = eng.prefix_salt(len(p))
            hit = pool.match_prefix(p[:-1], salt)
            owner = REUSE[name][i]
            assert hit == ([] if owner is None else held[owner][:2]), f"prompt {i}"
            table = hit + pool.allocate(eng.blocks_for(len(p)) - len(hit))
            held.append(table)
            cached = len(hit) * eng.block_size
            ours = eng.runner.prefill([PrefillChunk(p[cached:], cached, table, prompt_len=len(p))], all_logits=True)
            pool.commit_full_blocks(table, p, salt)
            torch.testing.assert_close(ours, hf_logits(hf, p)[cached:], atol=ATOL, rtol=0)
    finally:
        for t in held:
            pool.free(t)
    pool.check_integrity()


def test_generate_crossing_the_threshold_equals_transformers(model_dir: tuple[str, Path], hf: Any) -> None:
    """The reference `generate()`: greedy from a 24-token prompt over 48 positions (past 32) is transformers'."""
    eng = engine(model_dir[1], "native")
    ids = rand_ids(24, 5)
    out = generate(eng, ids, SamplingParams(max_tokens=NEW, ignore_eos=True), eos_token_ids=())
    assert out.token_ids == hf_generate(hf, ids)[0]


PHI3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=256, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
LLAMA = {**PHI3, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
SU = {"type": "su", "short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [1.0 + i for i in range(16)]}
CONFIGS = {
    # Phi-3-mini-128k as written: "su" (read as longrope), factor and original length from the config's own
    # fields (original_max_position_embeddings: the class default 4096 here), attention_factor derived
    "phi3-su-defaults": {**PHI3, "max_position_embeddings": 131072, "rope_scaling": SU},
    "phi3-longrope-given": {**PHI3, "max_position_embeddings": 8192, "original_max_position_embeddings": 2048,
                            "rope_scaling": {**SU, "type": "longrope", "factor": 3.0, "attention_factor": 1.5}},
    "phi4-partial": {**PHI3, "max_position_embeddings": 131072, "partial_rotary_factor": 0.75,
                     "rope_scaling": {**SU, "type": "longrope", "short_factor": SU["short_factor"][:12],
                                      "long_factor": SU["long_factor"][:12]}},
    "phi3-partial-plain": {**PHI3, "partial_rotary_factor": 0.5},
    "llama-dynamic": {**LLAMA, "max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2.5}},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tables_equal_transformers(name: str) -> None:
    """Every table's inverse frequencies and cos / sin gain, bit for bit, at lengths below, at and above
    the threshold (transformers' rope functions on its own reading of the same config dict)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from engine.model.config import ModelConfig
    from engine.model.rope import RotaryEmbedding, inv_freq

    raw = CONFIGS[name]
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    ours = ModelConfig.from_hf_dict(raw)
    params = ours.layer_rope(0)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    fn = ROPE_INIT_FUNCTIONS.get(rope_type, Phi3RotaryEmbedding.compute_default_rope_parameters)
    threshold = (ours.rope_scaling.original_max_position_embeddings if rope_type == "longrope"
                 else ours.max_position_embeddings)
    for seq_len in (None, threshold, threshold + 1, 3 * threshold + 5):
        want, gain = fn(hf_cfg, None, seq_len=None if seq_len is None else torch.tensor(seq_len))
        key = 0 if seq_len is None else params.table_key(seq_len)
        got = inv_freq(params.rotary_dim(ours.head_dim), params.theta, params.scaling, key)
        assert torch.equal(got, want), (seq_len, got, want)
        assert (ours.rope_scaling.attention_factor if ours.rope_scaling else 1.0) == gain
    rope = RotaryEmbedding(ours, 8, torch.device("cpu"))
    assert rope.rotary_width == 2 * want.shape[0] <= ours.head_dim
