"""`check_request`: each refusal a decode replica owes a request, next to a request one step away
from it that passes (so no check here can pass by refusing everything), without a model."""

from __future__ import annotations

import pytest

from decode_worker.request_checks import check_request
from decode_worker.types import DecodeChoice, DecodeRequest
from engine.sampling.sampler import SamplingParams
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout

LAYOUT = KVLayout(arch="llama", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
PROMPT = (1, 2, 3, 4)
# (colocated, local_prefill) of the three kinds of replica
COLOCATED, LOCAL_TOO, REMOTE_ONLY = (True, True), (False, True), (False, False)


def handle(n_tokens: int = len(PROMPT)) -> KVHandle:
    return KVHandle("t-1", "127.0.0.1", 4000, n_tokens, LAYOUT, 2e9)


def request(*, handle: KVHandle | None = None, choices: tuple[DecodeChoice, ...] = (DecodeChoice(0),),
            max_tokens: int = 8, prompt_logprobs: int | None = None) -> DecodeRequest:
    return DecodeRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens), choices, handle,
                         prompt_logprobs=prompt_logprobs)


def remote(prompt_logprobs: int | None = None) -> DecodeRequest:
    """Two choices whose KV a prefill replica built, each with its token 0."""
    return request(handle=handle(), choices=(DecodeChoice(0, 7), DecodeChoice(1, 9)), prompt_logprobs=prompt_logprobs)


@pytest.mark.parametrize("mode", [COLOCATED, LOCAL_TOO, REMOTE_ONLY])
def test_each_replica_takes_the_requests_of_its_path(mode: tuple[bool, bool]) -> None:
    colocated, local_prefill = mode
    if local_prefill:
        check_request(request(choices=(DecodeChoice(0), DecodeChoice(1))), *mode)
        check_request(request(prompt_logprobs=2), *mode)
    if not colocated:
        check_request(remote(), *mode)


def test_colocated_refuses_a_kv_handle() -> None:
    with pytest.raises(ValueError, match="colocated decode takes requests without a KV handle"):
        check_request(remote(), *COLOCATED)


def test_a_replica_that_prefills_nothing_refuses_a_request_without_a_handle() -> None:
    with pytest.raises(ValueError, match=r"needs a KV handle .*local_prefill is off"):
        check_request(request(), *REMOTE_ONLY)


def test_prompt_logprobs_only_where_the_prompt_is_prefilled() -> None:
    with pytest.raises(ValueError, match="prompt log-probs are computed where the prompt is prefilled"):
        check_request(remote(prompt_logprobs=1), *LOCAL_TOO)


@pytest.mark.parametrize("k", [-1, 10**6])
def test_prompt_logprobs_out_of_range_are_refused(k: int) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        check_request(request(prompt_logprobs=k), *COLOCATED)


def test_a_pulled_request_needs_token_0_for_every_choice() -> None:
    with pytest.raises(ValueError, match="each choice needs its token 0"):
        check_request(request(handle=handle(), choices=(DecodeChoice(0, 7), DecodeChoice(1))), *LOCAL_TOO)


def test_choices_prefilled_here_carry_no_token_0() -> None:
    with pytest.raises(ValueError, match="prefilled here, choices carry no token 0"):
        check_request(request(choices=(DecodeChoice(0, 7), DecodeChoice(1))), *COLOCATED)
    check_request(request(choices=(DecodeChoice(0, 7, (8,)),)), *COLOCATED)  # a continuation: one choice


def test_a_continuation_takes_no_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="a continuation takes no prompt log-probs"):
        check_request(request(choices=(DecodeChoice(0, 7),), prompt_logprobs=1), *COLOCATED)


def test_the_handle_must_hold_the_kv_the_request_needs() -> None:
    continuation = (DecodeChoice(0, 7, (8, 9)),)  # its KV: the prompt, token 0 and 8 (9 is fed next)
    check_request(request(handle=handle(len(PROMPT) + 2), choices=continuation), *LOCAL_TOO)
    with pytest.raises(ValueError, match=f"the KV handle holds {len(PROMPT)} tokens; this request needs 6"):
        check_request(request(handle=handle(), choices=continuation), *LOCAL_TOO)


def test_tokens_sent_must_leave_something_to_decode() -> None:
    continuation = (DecodeChoice(0, 7, (8, 9)),)  # three tokens sent
    check_request(request(choices=continuation, max_tokens=4), *COLOCATED)
    with pytest.raises(ValueError, match=r"3 tokens sent leave nothing of max_tokens=3 to decode"):
        check_request(request(choices=continuation, max_tokens=3), *COLOCATED)
