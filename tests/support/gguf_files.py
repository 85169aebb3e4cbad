"""GGUF files written the way llama.cpp writes them, from tiny transformers models (the GGUF tests' oracle).

llama.cpp's q/k permutation and HF→GGUF name table are restated here independently of
`engine.loading.gguf_loader`, so a converter bug cannot hide behind a shared table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QT

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
# llama.cpp's HF→GGUF names (gguf-py tensor_mapping), stated here independently of the loader.
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


TOKENS = SPECIALS + byte_alphabet() + ["".join(m.split()) for m in MERGES]


def llama_cpp_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """Exactly ``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{suffix}"
    _, _, layer, kind = base.split(".", 3)
    return f"blk.{layer}.{LAYER[kind]}.{suffix}"


def tiny_model(family: str, tied: bool, **overrides: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(TOKENS), max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    model: transformers.PreTrainedModel
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so a swapped name cannot hide
            p.normal_(0, 0.2)
    return model.float().eval()


def quantized(data: np.ndarray, qtype: QT) -> np.ndarray:
    """gguf's own quantizer; for a type gguf-py cannot write, zero bytes of the right size."""
    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:
        return np.zeros(gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), dtype=np.uint8)


def write_gguf(path: Path, model: transformers.PreTrainedModel, qtype: QT, arch: str = "llama",
               add_bos: bool = False, encode: Callable[[np.ndarray, QT], np.ndarray] = quantized) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, cfg.num_attention_heads, cfg.num_key_value_heads)
        data = t.numpy()
        tq = qtype if data.ndim == 2 else QT.F32  # llama.cpp keeps 1-D tensors in F32
        w.add_tensor(gguf_name(name), encode(data, tq), raw_dtype=tq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
