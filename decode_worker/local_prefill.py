"""The decode replica's own prefill: prompts (and continuations) whose KV it computes between decode steps.

Owns: `LocalPrefill`, the admitted `ChoiceGroup`s whose KV is still being written here (colocated
mode: every request; a continuation: the prompt and the tokens already sent but the last), how many
of each one's tokens a step computes, and what a finished prefill hands back.

A step's share: whole prompts at once (``chunk_size == 0``), or ``chunk_size`` tokens this step (or
the budget the caller passes: a disaggregated replica's per-step token budget, at most
``chunk_size``), split among the groups as the prefill pool splits its budget
(`engine.prefill_planner.grant_tokens`: earliest TTFT deadline first when any group's request carries
one, ``DecodeRequest.ttft_deadline``, a group without one due after every other; else oldest first),
each chunk written into its group's head's blocks. A group whose prompt a step completes gets its KV
marked in (`ChoiceGroup.kv_in`: the forks' shared partial block copied) and, unless it is a
continuation (its next token already sent: ``Stream.next_token``), token 0 of every choice sampled
from that step's last logits row.

Invariants: a group is here from admission until its prompt is complete or its head ends
(`LocalPrefill.discard`), never twice; ``head.prefilled`` only grows, by exactly the tokens of the
chunks a step computed for it; a head that ended while the step ran is skipped (its blocks are free).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

from decode_worker.choices import ChoiceGroup
from decode_worker.scheduler import DecodeScheduler
from engine.kv_cache import KVCache
from engine.prefill_planner import grant_tokens
from engine.runner import PrefillChunk
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplerState


class LocalPrefill:
    """The groups this replica prefills itself, in admission order."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size  # tokens per step over all groups; 0: every prompt whole
        self.groups: list[ChoiceGroup] = []

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, group: ChoiceGroup) -> None:
        self.groups.append(group)

    def discard(self, group: ChoiceGroup) -> None:
        with contextlib.suppress(ValueError):
            self.groups.remove(group)

    def remaining(self) -> list[int]:
        """Each group's prompt tokens still to prefill, in admission order."""
        return [len(g.head.req.kv_token_ids) - g.head.prefilled for g in self.groups]

    def plan(self, scheduler: DecodeScheduler, budget: int | None = None
             ) -> tuple[list[PrefillChunk], list[ChoiceGroup]]:
        """This step's chunks, one per group granted tokens (same order as the groups returned);
        ``budget``: this step's tokens over all groups (None: ``chunk_size``, or every prompt whole)."""
        remaining = self.remaining()
        if budget is None:
            budget = self.chunk_size or sum(remaining)
        cap = self.chunk_size or max(remaining, default=1)
        deadlines = None
        if any(g.req.ttft_deadline is not None for g in self.groups):
            deadlines = [math.inf if g.req.ttft_deadline is None else g.req.ttft_deadline for g in self.groups]
        chunks: list[PrefillChunk] = []
        groups: list[ChoiceGroup] = []
        for group, n in zip(self.groups, grant_tokens(remaining, budget, cap, deadlines), strict=True):
            if n == 0:
                continue
            st = group.head
            seq = scheduler.get(st.seq_id)
            assert seq is not None
            prompt = st.req.kv_token_ids  # a continuation's: the prompt and the tokens sent but the last
            chunks.append(PrefillChunk(prompt[st.prefilled : st.prefilled + n], st.prefilled, seq.block_ids,
                                       prompt_len=len(prompt)))
            groups.append(group)
        return chunks, groups

    @staticmethod
    def ending(groups: Sequence[ChoiceGroup], chunks: Sequence[PrefillChunk]
               ) -> list[tuple[int, list[SamplerState]]]:
        """(row, its choices' sampler states) of each group whose prompt these chunks complete and
        that samples token 0 (a continuation's next token was sent already: it samples nothing)."""
        return [(row, [m.sampler for m in g.streams]) for row, (g, c) in enumerate(zip(groups, chunks, strict=True))
                if g.head.prefilled + len(c.token_ids) == len(g.head.req.kv_token_ids) and g.head.next_token is None]

    def advance(self, groups: Sequence[ChoiceGroup], chunks: Sequence[PrefillChunk],
                scored: Sequence[PromptLogprobs | None], dt: float, live: Callable[[str], bool],
                scheduler: DecodeScheduler, cache: KVCache) -> list[tuple[int, ChoiceGroup]]:
        """Record a step's chunks; returns (row, group) of each group whose prompt is now complete
        (its KV in), for the caller to emit token 0 from that row. ``live(seq_id)``: the head still runs."""
        complete: list[tuple[int, ChoiceGroup]] = []
        for row, (group, chunk) in enumerate(zip(groups, chunks, strict=True)):
            st = group.head
            if not live(st.seq_id):
                continue  # ended while the step ran; its blocks are already free
            st.prefilled += len(chunk.token_ids)
            for member in group.streams:
                member.prefill_s += dt
            if (part := scored[row]) is not None:
                st.prompt_scores = part if st.prompt_scores is None else st.prompt_scores + part
            if st.prefilled < len(st.req.kv_token_ids):
                continue
            self.discard(group)
            group.kv_in(scheduler, cache)
            complete.append((row, group))
        return complete
