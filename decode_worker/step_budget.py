"""`StepBudget`: how many prompt tokens a disaggregated decode replica prefills in its next step.

Owns the replica's online step-time fit (`engine.step_fit.StepFit`, fed every step the worker
measures; `engine.step_model.PRIOR` until it has one) and the per-step budget it implies for the
LOCAL requests (prefilled here, `decode_worker.local_prefill`): `engine.step_model.step_token_budget`
of the streams the step decodes, their context and the tightest TPOT objective among them
(``DecodeRequest.tpot_s``; none: no cap but the chunk cap), at most the chunk cap
(``DecodeWorkerConfig.prefill_chunk_size``, from ``router.path_policy.max_chunk_tokens``).

Why at least one token while any prompt waits: the router sends a request LOCAL only when the budget
it estimates is positive, but the streams running here change after that; a budget of 0 would stall
a prompt already admitted here until they end. One token a step costs the running streams next to
nothing, and the prompt still advances. Colocated replicas keep the fixed chunk (their prompts have
nowhere else to go).
"""

from __future__ import annotations

from engine.step_fit import StepFit
from engine.step_model import PRIOR, TPOT_SAFETY, StepTimeModel, step_token_budget


class StepBudget:
    """The step fit and the LOCAL prefill budget of one decode replica."""

    def __init__(self, cap: int, safety: float = TPOT_SAFETY, prior: StepTimeModel = PRIOR) -> None:
        if cap < 0 or not 0 < safety <= 1:
            raise ValueError(f"need cap >= 0 and safety in (0, 1], got {cap}, {safety}")
        self.cap = cap  # the most prompt tokens a step prefills; 0: no cap (the waiting prompts whole)
        self.safety = safety
        self.fit = StepFit(prior)

    @property
    def model(self) -> StepTimeModel:
        """The replica's fit, else the prior."""
        return self.fit.model() or self.fit.prior

    def record(self, batch: int, context_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One step as measured (steps of no measurable length are skipped)."""
        if seconds > 0:
            self.fit.add(batch, context_tokens, prefill_tokens, seconds)

    def tokens(self, batch: int, context_tokens: int, tpot_s: float | None, waiting: int) -> int:
        """Prompt tokens the next step prefills beside ``batch`` decoding streams (``context_tokens`` in
        all, ``tpot_s`` the tightest objective among them) when ``waiting`` tokens wait here."""
        if waiting <= 0:
            return 0
        cap = min(self.cap, waiting) if self.cap else waiting
        return max(1, step_token_budget(self.model, batch, context_tokens, tpot_s, cap, self.safety))
