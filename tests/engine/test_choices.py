"""Per-choice seeds: choice 0 keeps the request's seed (so it is the n = 1 request), the others follow
the documented blake2b derivation, are stable, distinct, and only the seed differs between choices."""

from __future__ import annotations

import hashlib

import pytest

from engine.sampling.choices import choice_params, choice_seed
from engine.sampling.sampler import SamplingParams


def test_choice_zero_is_the_request_itself() -> None:
    params = SamplingParams(temperature=0.8, seed=7)
    assert choice_seed(7, 0) == 7 and choice_params(params, 0) is params


def test_other_choices_follow_the_documented_derivation() -> None:
    for seed, index in ((7, 1), (7, 15), (-3, 2), (2**70, 1)):
        digest = hashlib.blake2b(f"pdserve-choice:{seed}:{index}".encode(), digest_size=8).digest()
        assert choice_seed(seed, index) == int.from_bytes(digest, "little") & (2**63 - 1)


def test_seeds_are_distinct_and_only_the_seed_changes() -> None:
    seeds = {choice_seed(s, i) for s in range(50) for i in range(16)}
    assert len(seeds) == 50 * 16
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=9)
    other = choice_params(params, 4)
    assert other.seed == choice_seed(3, 4) and other.seed != 3
    assert SamplingParams(**{**other.__dict__, "seed": 3}) == params
    unseeded = SamplingParams(temperature=0.8)
    assert choice_params(unseeded, 4) is unseeded  # no seed: every choice draws from the process's generator
    with pytest.raises(ValueError):
        choice_seed(1, -1)
