"""`check_request`: the refusals a decode replica owes a request before any of its state is touched.

Owns the checks that read only the request and the replica's mode: where its KV comes from (a
handle, or prefilled here), what each choice carries (token 0, sent tokens), prompt log-probs, the
handle's token count, ``max_tokens`` against the tokens already sent. The checks that read the
replica's live state (the context bound, a request id already streaming, the queue bound) stay with
the worker's admission (`decode_worker.worker.DecodeWorker`), which runs them after these.

Why a pure function: each refusal is a caller's mistake the router must never make (a request sent
down the wrong path, a continuation built wrong), so each one names what is wrong and is tested
directly, without a model.

Invariants: a request that passes is one the worker can admit as it is: with a handle, every choice
carries its token 0 and the handle holds exactly ``kv_token_ids``; without one, the replica prefills
(``local_prefill``) and only a continuation (one choice alone) carries a token 0. Nothing is
mutated; every refusal is a `ValueError` whose text names the rule.
"""

from __future__ import annotations

from decode_worker.types import DecodeRequest
from engine.sampling.prompt_logprobs import check_prompt_logprobs


def check_request(req: DecodeRequest, colocated: bool, local_prefill: bool) -> None:
    """Refuse ``req`` where it cannot be served as sent to this replica.

    ``colocated``: the replica is a colocated one (it prefills every request itself);
    ``local_prefill``: it prefills requests without a KV handle (always true colocated)."""
    local = req.handle is None  # prefilled here (colocated, or a LOCAL request of a disaggregated cluster)
    if colocated and not local:
        raise ValueError("colocated decode takes requests without a KV handle")
    if local and not local_prefill:
        raise ValueError("disaggregated decode needs a KV handle (prefill first): this replica prefills "
                         "no request itself (decode_worker local_prefill is off: router.prefill_path 'remote')")
    if req.prompt_logprobs is not None and not local:
        raise ValueError("prompt log-probs are computed where the prompt is prefilled: a request whose KV "
                         "is pulled takes them from the prefill pool")
    check_prompt_logprobs(req.prompt_logprobs)
    if not local and any(c.first_token_id is None for c in req.choices):
        raise ValueError("each choice needs its token 0 from the prefill (a request with a KV handle)")
    if local and len(req.choices) > 1 and any(c.first_token_id is not None for c in req.choices):
        raise ValueError("prefilled here, choices carry no token 0 (a continuation, which does, is one "
                         "choice alone)")
    if req.prompt_logprobs is not None and req.choices[0].first_token_id is not None:
        raise ValueError("a continuation takes no prompt log-probs (token 0 carried them)")
    n_kv = len(req.kv_token_ids)  # a continuation's KV holds the tokens sent but the last, too
    if req.handle is not None and req.handle.n_tokens != n_kv:
        raise ValueError(f"the KV handle holds {req.handle.n_tokens} tokens; this request needs {n_kv}")
    if (sent := len(req.choices[0].generated)) >= req.sampling.max_tokens:
        raise ValueError(f"{sent} tokens sent leave nothing of max_tokens={req.sampling.max_tokens} to decode")
