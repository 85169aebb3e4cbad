"""The n choices of one request: each choice's sampling settings, derived from the request's.

Owns: `choice_seed` and `choice_params`, the one statement of how a request's ``seed`` becomes each
choice's seed. Both pools call them (token 0 is sampled on the prefill replica, the rest on a decode
replica), so a choice's text is the same whichever process samples which of its tokens.

The derivation: choice 0 keeps the request's seed ``s`` itself, so choice 0 of an ``n``-choice
request gives exactly the text of the same request with ``n = 1``; choice ``i > 0`` takes the first
63 bits (little-endian) of ``blake2b(b"pdserve-choice:" + f"{s}:{i}".encode(), digest_size=8)``: a
function of ``(s, i)`` alone, stable across processes and machines (unlike ``hash()``), and with no
arithmetic relation to other seeds (choice 1 of seed ``s`` is not choice 0 of some nearby seed).
A request without a seed keeps none: its choices draw from the process's generator and differ from
each other; greedy choices (``temperature == 0``) are all the same text.

Invariants: ``choice_params(p, 0) is p``; only ``seed`` differs between choices.
"""

from __future__ import annotations

import dataclasses
import hashlib

from engine.sampling.sampler import SamplingParams

#: the most choices one request may ask for (the router's bound on ``n``)
MAX_CHOICES = 16


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed for a request seeded with ``seed`` (see the module docstring)."""
    if index < 0:
        raise ValueError(f"choice index must be >= 0, got {index}")
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"pdserve-choice:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling settings of choice ``index``: the request's, with the choice's seed."""
    if index < 0:
        raise ValueError(f"choice index must be >= 0, got {index}")
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=choice_seed(params.seed, index))
