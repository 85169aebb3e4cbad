"""`StepFit`: a decode replica's own step-time model, fitted online from the steps it measures.

Owns: the window of a replica's recent steps (sequences decoded, the context they attend to, prompt
tokens prefilled beside them, seconds) and the `engine.step_model.StepTimeModel` they imply, by
least squares with every coefficient held ≥ 0 (and the fixed part > 0).

Why online, from the replica itself: the per-step prefill budget (`engine.step_model.step_token_budget`)
and the router's path decision (`router.path_choice`, from the fit in the replica's load report) are
only as good as the step model; a profile measured once on another machine, or under another load,
drifts from what this replica's steps take now, and the replica times every step anyway.

Why a prior: until ``min_samples`` steps are in the window there is no fit (`model` is None, and the
caller uses `engine.step_model.PRIOR`); and a term the window cannot identify (its column holds one
value only, e.g. no step in the window prefilled anything) keeps the prior's coefficient rather than
a least-squares guess that could be anything, e.g. 0 (an unbounded prefill budget).

How: the identifiable columns are solved by least squares on the residual of the others' prior terms;
a negative coefficient (noise, or two collinear columns) is dropped to 0 and the rest refitted, until
none is negative (an active-set non-negative least squares, over at most four columns). The fixed
part is held at least ``MIN_BASE_S``. Pure: no clock; the caller passes each step's measured seconds.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.step_model import StepTimeModel

#: the least fixed part of a fitted step (a step time must stay positive)
MIN_BASE_S = 1e-5

_NAMES = ("base_s", "per_seq_s", "per_context_token_s", "per_prefill_token_s")


class StepFit:
    """The last ``window`` steps of one replica and their least-squares `StepTimeModel`."""

    def __init__(self, prior: StepTimeModel, window: int = 512, min_samples: int = 32) -> None:
        if window < min_samples or min_samples < len(_NAMES):
            raise ValueError(f"need window >= min_samples >= {len(_NAMES)}, got {window}, {min_samples}")
        self.prior = prior
        self.min_samples = min_samples
        self._steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._model: StepTimeModel | None = None
        self._stale = False

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, batch: int, context_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """One measured step: ``batch`` sequences decoded over ``context_tokens``, ``prefill_tokens``
        prompt tokens prefilled beside them, in ``seconds``."""
        if min(batch, context_tokens, prefill_tokens) < 0 or not seconds > 0:
            raise ValueError(f"a step needs sizes >= 0 and seconds > 0, got {batch}, {context_tokens}, "
                             f"{prefill_tokens}, {seconds}")
        self._steps.append((batch, context_tokens, prefill_tokens, seconds))
        self._stale = True

    def model(self) -> StepTimeModel | None:
        """The fit of the window (None before ``min_samples`` steps); refitted only after new steps."""
        if len(self._steps) < self.min_samples:
            return None
        if self._stale:
            self._model = self._fit()
            self._stale = False
        return self._model

    def _fit(self) -> StepTimeModel:
        data = np.array(self._steps, dtype=np.float64)  # [N, 4]: batch, context, prefill, seconds
        x = np.column_stack([np.ones(len(data)), data[:, :3]])  # [N, 4]: one column per coefficient
        y = data[:, 3]  # [N]
        prior = np.array([getattr(self.prior, n) for n in _NAMES])  # [4]
        coef = prior.copy()
        free = [0] + [k for k in range(1, 4) if np.ptp(x[:, k]) > 0]  # identifiable columns
        fixed = [k for k in range(4) if k not in free]
        residual = y - x[:, fixed] @ prior[fixed]  # [N]
        while True:
            sol, *_ = np.linalg.lstsq(x[:, free], residual, rcond=None)
            negative = [k for k, c in zip(free, sol, strict=True) if c < 0 and k != 0]
            if not negative:
                break
            worst = min(negative, key=lambda k: sol[free.index(k)])
            free.remove(worst)
            coef[worst] = 0.0
        coef[free] = sol
        coef[0] = max(coef[0], MIN_BASE_S)
        return StepTimeModel(*(float(c) for c in coef))
