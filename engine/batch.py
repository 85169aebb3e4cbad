"""The inputs of the model's two forwards, as `engine.runner` builds them from per-sequence descriptions.

Owns: `PrefillBatch` (several prefill chunks, flattened) and `DecodeBatch` (one token per sequence),
device tensors plus the host-side lengths a backend plans with (so planning never waits on the
device). Backends turn them into their own per-step metadata (`engine.attention.base`).

Invariants: built once per step and shared by every layer; every tensor is on the engine's device;
a block table covers every position its row reads or writes; padding entries of a decode block
table are block 0 (a valid id) and lie beyond the row's length, so a backend must mask them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillBatch:
    """Flattened inputs of several prefill chunks (built by `engine.runner`)."""

    token_ids: torch.Tensor  # [T] all chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token
    seq_lens: list[int]  # tokens of each chunk; sums to T
    prompt_lens: list[int]  # the whole prompt's length of each chunk (a length-dependent RoPE's table)
    start_positions: list[int]  # cached tokens before each chunk
    block_tables: list[torch.Tensor]  # per chunk: [ceil((start + len) / bs)] block ids of positions 0..end-1
    logits_index: torch.Tensor  # [N] rows of T whose logits are wanted

    @property
    def fresh(self) -> bool:
        """Every chunk starts at position 0 (no cached prefix to read)."""
        return not any(self.start_positions)


@dataclass
class DecodeBatch:
    """One decode step (built by `engine.runner`), rows sorted by ascending context length."""

    token_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B] the new token's position (its context is positions 0..p)
    slots: torch.Tensor  # [B] slot of the new token
    block_table: torch.Tensor  # [B, n_blocks] padded with block 0 beyond each row's blocks
    context_lens: list[int]  # [B] on the host: position + 1 of each row
    row_blocks: list[int]  # [B] on the host: blocks each row's context spans

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64 visible positions of each row (position + 1), on the device."""
        return self.positions + 1
