"""Writes `deploy/profiles/h100-llama3-8b-roofline.json`: a ROOFLINE ESTIMATE (not a measurement) of
one Llama-3-8B replica (bf16, one H100 SXM) in the capacity planner's profile format.

Owns the arithmetic, so the shipped numbers can be re-derived and questioned. A forward takes the
longer of its compute time and its memory time, plus a fixed launch overhead:
- compute: ``2 * params`` FLOPs a token for the matmuls, ``4 * layers * hidden * context`` a token for
  attention, at ``PEAK_FLOPS * MFU``;
- memory: every weight read once a forward, plus each sequence's KV (``kv_bytes_per_token`` a
  context token), at ``HBM_BYTES_PER_S * MBU``.
The efficiencies are assumptions, stated here; a measured profile (`pdserve profile` on the GPU)
replaces this file wherever one exists.

Run: ``python -m loadtests.roofline_profile [out.json]``.
"""

from __future__ import annotations

import sys

from cluster.planner.profile import DecodePoint, PrefillPoint, ReplicaProfile

PARAMS = 8.03e9  # Llama-3-8B
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 32, 4096, 8, 128
BYTES = 2  # bf16
PEAK_FLOPS = 989e12  # H100 SXM dense bf16
HBM_BYTES_PER_S = 3.35e12
MFU, MBU = 0.6, 0.8  # assumed achievable shares of the peaks
OVERHEAD_S = 0.002  # per forward: launches, sampling, the host's share
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES  # K and V: 128 KiB
GPU_MEMORY, KV_SHARE = 80e9, 0.9
ACTIVATIONS = 4e9  # the peak step's working memory, held back from the KV cache
BLOCK = 16
TRANSFER_BYTES_PER_S = 25e9  # one 400 Gb/s RDMA link per GPU at about half its line rate


def forward_s(tokens: int, attended: float, kv_tokens: int) -> float:
    """``tokens`` new tokens each attending ``attended`` tokens on average; ``kv_tokens`` of KV read."""
    flops = 2 * PARAMS * tokens + 4 * LAYERS * HIDDEN * tokens * attended
    mem = PARAMS * BYTES + kv_tokens * KV_BYTES_PER_TOKEN
    return max(flops / (PEAK_FLOPS * MFU), mem / (HBM_BYTES_PER_S * MBU)) + OVERHEAD_S


def profile() -> ReplicaProfile:
    prefill = tuple(PrefillPoint(t, round(forward_s(t, t / 2, t), 6))
                    for t in (16, 64, 256, 512, 1024, 2048, 4096, 8192))
    decode = tuple(DecodePoint(b, c, round(forward_s(b, c, b * c), 6))
                   for b in (1, 4, 16, 64, 128, 256) for c in (256, 1024, 4096))
    kv_bytes = GPU_MEMORY * KV_SHARE - PARAMS * BYTES - ACTIVATIONS
    return ReplicaProfile(
        label="Llama-3-8B bf16 on one H100 SXM (roofline estimate)", source="roofline estimate",
        hardware="NVIDIA H100 SXM 80GB (assumed, not measured)", model="meta-llama/Meta-Llama-3-8B",
        gpus_per_replica=1, block_size=BLOCK, kv_blocks=int(kv_bytes // (KV_BYTES_PER_TOKEN * BLOCK)),
        max_num_seqs=256, kv_bytes_per_token=KV_BYTES_PER_TOKEN, transfer_bytes_per_s=TRANSFER_BYTES_PER_S,
        prefill=prefill, decode=decode,
        notes=(f"ROOFLINE ESTIMATE, NOT A MEASUREMENT: max(compute at {MFU:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s, "
               f"memory at {MBU:.0%} of {HBM_BYTES_PER_S / 1e12:.2f} TB/s) + {OVERHEAD_S * 1e3:.0f} ms a forward; "
               "written by loadtests/roofline_profile.py"))


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "deploy/profiles/h100-llama3-8b-roofline.json"
    profile().save(out)
    print(out)
