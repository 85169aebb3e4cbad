"""Moving a request's choices off a decode replica that went away: the continuation requests.

Owns: `DecodeLost` (the decode stream broke: its replica died, or sent nothing within the token
timeout), `MIGRATION_REASONS`, and the two calls that continue one choice elsewhere:
`continuation_prefill` (the KV it needs, built by the prefill pool) and `continuation` (the decode
call that continues it).

Why a continuation is exact: the router holds each choice's prompt and every token it sent. The
KV a decode replica needs is that of the prompt and the sent tokens but the last
(`decode_worker.types.DecodeRequest.kv_token_ids`); the last is fed at its first step. Everything
else the sampler reads follows from the tokens sent (`decode_worker.types.DecodeChoice.decoded`):
the step index of a seeded draw, penalties, ``min_tokens``, the grammar matcher (replayed), the rest
of ``max_tokens``; the choice's index keeps its seed. The router's own detokenizer and stop
strings never stopped, so the client's stream only pauses.

Invariants: each live choice moves as its own continuation (choices differ past token 0, so they
share no KV), under its own decode request id (``<request id>:m<k>.<index>``: a replica that hung
and wakes may still hold the old id); the prompt is prefilled with settings that cannot end it at
token 0 (no stop ids, one decode token's room), and that token is ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.types import DecodeChoice, DecodeRequest
from engine.sampling.sampler import SamplingParams
from kv_transfer.handle import KVHandle
from prefill_worker.types import PrefillRequest

#: why a request migrated (the label of ``pdserve_router_migrations_total``)
REPLICA_DIED = "replica_died"
TOKEN_TIMEOUT = "token_timeout"
MIGRATION_REASONS = (REPLICA_DIED, TOKEN_TIMEOUT)


class DecodeLost(Exception):
    """A decode stream broke mid-request: its replica went away (``REPLICA_DIED``) or sent nothing
    within the token timeout (``TOKEN_TIMEOUT``). What was streamed before it stands."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in MIGRATION_REASONS:
            raise ValueError(f"unknown migration reason {reason!r}")
        super().__init__(detail)
        self.reason = reason


def continuation_id(request_id: str, move: int, index: int) -> str:
    """The decode request id of choice ``index``'s continuation number ``move`` (from 1)."""
    return f"{request_id}:m{move}.{index}"


def continuation_prefill(request_id: str, prompt: Sequence[int], generated: Sequence[int],
                         arrival_time: float = 0.0) -> PrefillRequest:
    """The prefill that builds a continuation's KV: the prompt and every sent token but the last.
    Greedy, no stop ids, two tokens of room: nothing ends it at its token 0, which is ignored."""
    if not generated:
        raise ValueError("a continuation needs at least token 0 (a request with none is resubmitted as it was)")
    tokens = (*prompt, *generated[:-1])
    return PrefillRequest(request_id=request_id, prompt_token_ids=tuple(tokens),
                          sampling=SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=arrival_time)


def continuation(request_id: str, prompt: Sequence[int], sampling: SamplingParams, index: int,
                 generated: Sequence[int], handle: KVHandle | None, arrival_time: float = 0.0) -> DecodeRequest:
    """Choice ``index`` continued after ``generated`` (token 0 first), its KV at ``handle``
    (colocated: None, the decode replica prefills it)."""
    if not generated:
        raise ValueError("a continuation needs at least token 0")
    if len(generated) >= sampling.max_tokens:
        raise ValueError(f"choice {index} has all its max_tokens={sampling.max_tokens}: nothing to continue")
    choice = DecodeChoice(index, generated[0], tuple(generated[1:]))
    return DecodeRequest(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling,
                         handle=handle, arrival_time=arrival_time, choices=(choice,))
