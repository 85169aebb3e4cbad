"""The inputs of the model's two forwards, as `engine.runner` builds them from per-sequence descriptions.

Owns: `PrefillBatch` (several prefill chunks, flattened) and `DecodeBatch` (one token per sequence);
`engine.model.model` only reads them. Invariant: every tensor of a decode batch is shared by all layers,
so it is built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.ops import PagedDecodeMeta


@dataclass
class PrefillBatch:
    """Flattened inputs of several prefill chunks (built by `engine.runner`)."""

    token_ids: torch.Tensor  # [T] all chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token
    seq_lens: list[int]  # tokens of each chunk; sums to T
    prompt_lens: list[int]  # the whole prompt's length of each chunk (a length-dependent RoPE's table)
    start_positions: list[int]  # cached tokens before each chunk
    context_blocks: list[torch.Tensor | None]  # per chunk: [ceil((start + len) / bs)] block ids, None if start == 0
    logits_index: torch.Tensor  # [N] rows of T whose logits are wanted


@dataclass
class DecodeBatch:
    """One decode step (built by `engine.runner`): every tensor here is shared by all layers."""

    token_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] slot of the new token
    block_table: torch.Tensor  # [B, n_blocks] padded with a valid block id (masked out)
    bias: torch.Tensor  # [B, 1, n_blocks * block_size] fp32: 0 where a position is visible, -inf after
    # Consecutive row ranges of similar context length, each padded only to its own longest: one
    # long sequence no longer makes every short one attend over its length. Empty: one group.
    groups: list[PagedDecodeMeta] = field(default_factory=list)
