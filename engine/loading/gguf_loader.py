"""GGUF (llama.cpp) → Hugging Face folder conversion.

Owns: reading a GGUF file, dequantizing its tensors (to bf16 for the K-quants, else fp32; Q8_0 kept
as it is stored, below), renaming them to Hugging Face Llama/Qwen2 names, undoing llama.cpp's q/k
row permutation, and writing an HF-style folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``).

Invariants:
- The output folder appears whole or not at all: everything is written into a temporary folder beside
  it and renamed into place; on any error the temporary folder is removed.
- Every tensor in the file is either mapped or refused: nothing is silently dropped.
- GGUF lists dimensions innermost-first (``ne``); torch/HF shapes are the reverse. A tensor's HF shape
  is ``tuple(reversed(tensor.shape))``, and that is checked, not assumed.
- Every failure is a `ModelLoadError` whose message starts with the file's path.
- K-quant tensors (`BF16_TYPES`) are written in bf16, half fp32's bytes: their 2-6 bit values are
  already far coarser than bf16's rounding. A Q8_0 linear weight (not the token embedding) is
  written as its int8 values ``X.weight [out, in]`` and its blocks' fp16 scales
  ``X.weight_scale [out, in / 32]``, exactly the file's numbers (`engine.loading.weights` dequantizes them,
  or keeps them for the int8 kernel, `engine.kernels.group_int8`); such a folder is pdserve's, not one
  transformers loads. F16 and BF16 tensors are written as stored (``config.json``'s ``torch_dtype``
  says so where every dense matrix has that dtype). Every other tensor keeps the fp32 gguf's
  dequantizer gives (so Q4_0 / Q4_1 / Q5 files, the bundled model among them, convert as they did).
- Memory: the GGUF file is memory-mapped and ``model.safetensors`` written one tensor at a time
  (`engine.loading.safetensors_stream`), so a conversion holds the mapped file and one tensor, never the
  whole converted model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, ReaderTensor
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.loading.gguf_identity import CONVERTER_VERSION, MARKER_FILE, file_fingerprint
from engine.loading.safetensors_stream import SafetensorsStream, TensorSpec

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Types tested here (F32, F16, BF16, Q4_0, Q4_1, Q8_0) plus the k-quants `gguf` dequantizes too.
SUPPORTED_TYPES = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
                             QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K})
#: Dequantized to bf16 (the K-quants); a 7B Q4_K_M file becomes ~14 GB, not ~28 GB of fp32.
BF16_TYPES = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K})
#: Written as the file stores them (their bytes copied): no fp32 copy twice the file's size.
STORED_TYPES = {QT.F16: torch.float16, QT.BF16: torch.bfloat16}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2")
_SPLIT_PRE = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
_DIGITS_PRE = ("smollm", "starcoder", "refact")  # llama.cpp: "\p{N}" split, then the GPT-2 regex
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_MISSING = object()


def hf_tensor_name(name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; unknown names raise KeyError."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise KeyError(name)
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    blk, layer, kind = [*base.split(".", 2), "", ""][:3]
    if blk != "blk" or not layer.isdigit() or kind not in _LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``LlamaModel.permute`` over the rows of a q/k weight [out, in] or bias [out].

    llama.cpp interleaves each head's two rotary halves (GPT-J style RoPE); HF's rotate_half wants them
    as two contiguous halves again.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Meta:
    """Typed access to a reader's key/value metadata; missing required keys name the file."""

    def __init__(self, reader: GGUFReader, source: Path) -> None:
        self._reader, self.source = reader, source

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.source}: GGUF metadata is missing {key!r}")
            return default
        return field.contents()


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error on damaged files
        raise ModelLoadError(
            f"{path}: not a valid GGUF file, or truncated ({type(e).__name__}: {e})") from None


def _hf_config(meta: _Meta, arch: str, n_vocab: int, tied: bool, has_qkv_bias: bool,
               dtype: str) -> dict[str, Any]:
    n_head = int(meta.get(f"{arch}.attention.head_count"))
    hidden = int(meta.get(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
    if int(meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{meta.source}: partial rotary embeddings are not supported")
    eos = int(meta.get("tokenizer.ggml.eos_token_id"))
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "vocab_size": n_vocab, "hidden_size": hidden, "head_dim": head_dim,
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.get(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length")),
        "tie_word_embeddings": tied, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos, "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": dtype,
    }
    if arch == "llama":
        cfg.update(attention_bias=has_qkv_bias, mlp_bias=False)
    return cfg


def _shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne order → torch order


def _keeps_q8(t: ReaderTensor) -> bool:
    """Whether ``t`` is written as int8 values and block scales: a 2-D Q8_0 tensor a linear layer
    multiplies by. The token embedding is a table rows are gathered from, written dense as before."""
    return QT(t.tensor_type) == QT.Q8_0 and len(_shape(t)) == 2 and t.name != "token_embd.weight"


def _specs(t: ReaderTensor, hf_name: str, source: Path) -> list[TensorSpec]:
    """What ``t`` becomes in ``model.safetensors``: its dtype and shape (two tensors for Q8_0)."""
    qtype = QT(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{source}: tensor {t.name!r} has unsupported type {qtype.name}; "
                             f"supported: {sorted(q.name for q in SUPPORTED_TYPES)}")
    shape = _shape(t)
    if _keeps_q8(t):
        rows, cols = shape
        block = GGML_QUANT_SIZES[QT.Q8_0][0]
        return [TensorSpec(hf_name, torch.int8, shape),
                TensorSpec(hf_name + "_scale", torch.float16, (rows, cols // block))]
    if qtype in STORED_TYPES:
        return [TensorSpec(hf_name, STORED_TYPES[qtype], shape)]
    return [TensorSpec(hf_name, torch.bfloat16 if qtype in BF16_TYPES else torch.float32, shape)]


def _tensors(t: ReaderTensor, source: Path) -> list[torch.Tensor]:
    """The tensor as `_specs` says, in torch's shape order: Q8_0 as (int8 values, fp16 scales) read
    straight from its blocks, F16 / BF16 as stored; else dequantized, bf16 for `BF16_TYPES`, else fp32."""
    qtype = QT(t.tensor_type)
    shape = _shape(t)
    try:
        if _keeps_q8(t):
            block, size = GGML_QUANT_SIZES[QT.Q8_0]  # 32 values, 34 bytes: fp16 scale, then 32 int8
            raw = np.asarray(t.data).reshape(-1, size)
            scale = raw[:, :2].copy().view(np.float16).reshape(shape[0], shape[1] // block)
            q = raw[:, 2:].copy().view(np.int8).reshape(shape)
            return [torch.from_numpy(q), torch.from_numpy(scale)]
        if qtype in STORED_TYPES:  # the bytes as they are (gguf gives F16 as float16, BF16 as raw bytes)
            data = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy()
            return [torch.from_numpy(data).view(STORED_TYPES[qtype]).reshape(shape)]
        arr = np.asarray(dequantize(t.data, qtype), dtype=np.float32).reshape(shape)
    except ValueError as e:
        raise ModelLoadError(f"{source}: tensor {t.name!r} ({qtype.name}, {shape}) is damaged: {e}") from None
    w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # (F32: a view of the mapped file)
    return [w.to(torch.bfloat16) if qtype in BF16_TYPES else w]


def _build_tokenizer(meta: _Meta) -> tuple[HFTokenizer, dict[str, Any]]:
    """A ``tokenizers`` BPE tokenizer and the special-token part of ``tokenizer_config.json``."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"{meta.source}: tokenizer model {model!r} is not supported (only 'gpt2' BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError(f"{meta.source}: token list has duplicate entries")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    tok = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,  # type: ignore[arg-type]
                                 ignore_merges=pre in ("llama-bpe", "llama3")))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLIT_PRE)
    if pre in _SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"), byte_level])
    elif pre in _DIGITS_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in _GPT2_PRE:
        tok.pre_tokenizer = byte_level
    else:
        raise ModelLoadError(f"{meta.source}: pre-tokenizer {pre!r} is not supported; supported: "
                             f"{sorted([*_GPT2_PRE, *_SPLIT_PRE, *_DIGITS_PRE])}")
    tok.decoder = decoders.ByteLevel()
    if len(types) != len(tokens):
        raise ModelLoadError(f"{meta.source}: {len(types)} token types for {len(tokens)} tokens")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])

    def name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = name("bos")
    add_bos = bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if bos is not None and add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = {"bos_token": name("bos"), "eos_token": name("eos"), "pad_token": name("padding"),
               "unk_token": name("unknown"), "add_bos_token": add_bos, "add_eos_token": False}
    return tok, special


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into the Hugging Face folder ``out_dir`` (replaced if present); returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    meta = _Meta(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: unsupported architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{gguf_path}: per-frequency RoPE scaling (rope_freqs) is not supported")
    n_head = int(meta.get(f"{arch}.attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    tokenizer, special = _build_tokenizer(meta)
    template = meta.get("tokenizer.chat_template", None)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every replica on the host
        plan: list[tuple[ReaderTensor, str]] = []
        specs: list[TensorSpec] = []
        for t in reader.tensors:
            try:
                hf_name = hf_tensor_name(t.name)
            except KeyError:
                raise ModelLoadError(f"{gguf_path}: unexpected tensor {t.name!r} for arch {arch!r}") from None
            plan.append((t, hf_name))
            specs += _specs(t, hf_name, gguf_path)
        shapes = {s.name: s.shape for s in specs}
        if "model.embed_tokens.weight" not in shapes:
            raise ModelLoadError(f"{gguf_path}: no token_embd.weight tensor")
        n_vocab = shapes["model.embed_tokens.weight"][0]
        has_bias = "model.layers.0.self_attn.q_proj.bias" in shapes
        matrices = {s.dtype for s in specs if len(s.shape) == 2 and s.dtype != torch.int8 and
                    not s.name.endswith("_scale")}  # the dense weights' dtype, where they share one
        dtype = str(matrices.pop()).removeprefix("torch.") if len(matrices) == 1 else "float32"
        config = _hf_config(meta, arch, n_vocab, tied="lm_head.weight" not in shapes, has_qkv_bias=has_bias,
                            dtype=dtype)
        with SafetensorsStream(tmp / "model.safetensors", specs, metadata={"format": "pt"}) as out:
            for t, hf_name in tqdm(plan, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress):
                parts = _tensors(t, gguf_path)
                if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):  # rows, with their scales
                    parts = [unpermute_qk(w, n_head if ".attn_q." in t.name else n_kv) for w in parts]
                for spec_name, w in zip([hf_name, hf_name + "_scale"], parts, strict=False):
                    out.write(spec_name, w)
        tokenizer.save(str(tmp / "tokenizer.json"))
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "chat_template": template,
                   "clean_up_tokenization_spaces": False,
                   "model_max_length": config["max_position_embeddings"]}
        eos_ids = [config["eos_token_id"]]
        eot = meta.get("tokenizer.ggml.eot_token_id", None)
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        gen_cfg = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids[0] if len(eos_ids) == 1
                   else eos_ids, "pad_token_id": config["pad_token_id"]}
        marker = {"converter_version": CONVERTER_VERSION, "source": str(gguf_path.resolve()),
                  "size": gguf_path.stat().st_size, "fingerprint": file_fingerprint(gguf_path)}
        for fname, obj in (("config.json", config), ("tokenizer_config.json", tok_cfg),
                           ("generation_config.json", gen_cfg), (MARKER_FILE, marker)):
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``; an existing ``dst`` is swapped out, then deleted."""
    old: Path | None = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
