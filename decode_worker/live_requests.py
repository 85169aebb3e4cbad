"""`LiveRequests`: a decode worker's admitted requests, their streams, and how each stream ends.

Owns admission (`admit`: the request's own checks, `decode_worker.request_checks`, then those that
read this replica's state: the context bound, a request id already streaming, the queue bound; then
its `ChoiceGroup` and its head's sequence in the scheduler's **waiting**), the live streams by
sequence id and groups by request id, the end of a stream (`end`: its final event, its sequence
finished in the scheduler, its swap slot and any local prefill of its group dropped) and abort (the
caller went away: `abort`).

Invariants: touched only on the event loop. A stream is in ``streams`` from admission until its
final event; a group is in ``groups`` while any of its streams is; each stream gets exactly one
final event. Ending the head of a group before its KV is in ends every stream of the group (the
scheduler finishes its forks with it). An aborted stream whose KV is being pulled into its blocks is
ended by the pull when it finishes, never before, so nothing is ever written into blocks someone
else owns; one whose handle was never pulled has its source's blocks released (or left to the lease).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from decode_worker.choices import ChoiceGroup
from decode_worker.importer import KVImporter
from decode_worker.local_prefill import LocalPrefill
from decode_worker.request_checks import check_request
from decode_worker.scheduler import DecodeScheduler
from decode_worker.seq_state import SeqStatus
from decode_worker.stream import Stream
from decode_worker.swap_space import HostSwapSpace
from decode_worker.types import DecodeRequest
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.sampling.grammar import GrammarVocab

log = logging.getLogger(__name__)


class LiveRequests:
    """The requests a decode worker is serving, from admission to each stream's final event."""

    def __init__(self, engine: Engine, scheduler: DecodeScheduler, prefilling: LocalPrefill,
                 swap_space: HostSwapSpace, importer: KVImporter | None, eos_ids: Sequence[int],
                 max_queue: int) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.prefilling = prefilling
        self.swap_space = swap_space
        self.importer = importer
        self.eos_ids = tuple(eos_ids)
        self.max_queue = max_queue
        self.streams: dict[str, Stream] = {}  # by sequence id
        self.groups: dict[str, ChoiceGroup] = {}  # by request id, while any of its streams is live
        self.num_finished = 0
        self._background: set[asyncio.Future[None]] = set()

    def admit(self, req: DecodeRequest, vocab: GrammarVocab | None, colocated: bool, local_prefill: bool
              ) -> ChoiceGroup:
        """Check ``req`` and add its group, its head's sequence waiting in the scheduler."""
        check_request(req, colocated, local_prefill)
        self.engine.check_length(len(req.prompt_token_ids), req.sampling.max_tokens)
        if req.request_id in self.groups:
            raise ValueError(f"request id {req.request_id!r} is already streaming")
        if self.queued_beyond_free_slots() >= self.max_queue:
            raise QueueFullError(f"decode queue is full ({self.max_queue} waiting)", 1.0)
        group = ChoiceGroup.new(req, self.eos_ids, vocab)  # a grammar rejecting a sent token raises here
        forks = [st.seq_id for st in group.streams[1:]]
        self.scheduler.add(group.head.seq_id, len(req.kv_token_ids), arrival=group.head.enqueued, forks=forks)
        self.groups[req.request_id] = group
        self.streams.update((st.seq_id, st) for st in group.streams)
        return group

    def queued_beyond_free_slots(self) -> int:
        """Waiting sequences that the next ``schedule()`` cannot admit for want of a batch slot.

        Requests that arrive together all sit in ``waiting`` until the step loop runs; those that
        free slots will take are not queued, so they do not count against ``max_queue``.
        """
        s = self.scheduler
        live = s.num_running + s.num_transferring + s.num_swapped
        return s.num_waiting - max(0, self.engine.config.max_num_seqs - live)

    def abort(self, stream: Stream) -> None:
        """The caller went away: free now, or as soon as a transfer into the blocks has finished."""
        stream.aborted = True
        seq = self.scheduler.get(stream.seq_id)
        group = self.groups.get(stream.request_id)
        pulling = group is not None and group.pull_task is not None
        if seq is not None and seq.status is SeqStatus.TRANSFERRING and pulling:
            return  # the pull task sees `aborted` and finishes the sequence
        head = group is not None and group.head is stream
        if seq is not None and seq.status is SeqStatus.WAITING and stream.req.handle is not None and head:
            task = asyncio.ensure_future(self._release(stream))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self.end(stream, "abort")

    async def _release(self, stream: Stream) -> None:
        assert self.importer is not None and stream.req.handle is not None
        try:
            await self.importer.release(stream.req.handle)
        except Exception as e:  # the lease frees the blocks anyway
            log.warning("release of %s failed: %s", stream.request_id, e)

    def end(self, stream: Stream, reason: str, error: str | None = None, code: str | None = None) -> None:
        """Finish a stream without a new token; frees its blocks and forgets it. A group's head
        before its KV is in takes the group's other streams with it (their forks end with it)."""
        stream.close(reason, error, code)
        for other in filter(None, map(self.streams.get, self.forget(stream)[1:])):
            other.close(reason, error, code)
            self.forget(other)

    def end_all(self, reason: str, error: str) -> None:
        for st in list(self.streams.values()):
            self.end(st, reason, error)

    def forget(self, stream: Stream) -> list[str]:
        """Drop a stream (its sequence freed); returns the sequences the scheduler finished."""
        finished = self.scheduler.finish(stream.seq_id)
        self.swap_space.release(stream.seq_id)
        group = self.groups.get(stream.request_id)
        if group is not None and group.head is stream:
            self.prefilling.discard(group)
        if self.streams.pop(stream.seq_id, None) is not None:
            self.num_finished += 1
        if group is not None and not any(st.seq_id in self.streams for st in group.streams):
            del self.groups[stream.request_id]
        return finished
