"""`Outbox`: the prefill side's finished prompts, holding their KV blocks under a lease until pulled.

Life cycle of an entry:

    put ──▶ PENDING ──take_for_transfer──▶ IN FLIGHT ──done──▶ freed (done)
              │  ▲                            │
              │  └───────────requeue──────────┘   (the send failed: back under its lease)
              ├──release──▶ freed (released)      release while in flight: freed when it ends
              └──expire───▶ freed (expired)       never while in flight: no free under a send

Invariants: each entry's blocks go to ``free_fn`` exactly once, whatever the interleaving of
`done` / `release` / `expire` / `requeue` (entries leave the table under a lock before ``free_fn``
runs, outside it); an in-flight entry is never expired; `take_for_transfer` refuses unknown, expired
and in-flight ids with a reason. Thread-safe. ``free_fn`` runs on the thread that made the call.
Times come from ``clock`` (monotonic by default); ``put`` returns the expiry on that clock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import TransferRefused

_HISTORY = 4096  # remembered fates of finished ids, for better refusal reasons
_FATE_WORDS = {"done": "pulled", "released": "released", "expired": "expired (its lease ran out)"}


@dataclass
class _Entry:
    transfer_id: str
    block_ids: tuple[int, ...]
    n_tokens: int
    expires_at: float
    in_flight: bool = False
    release_requested: bool = False


@dataclass(frozen=True)
class OutboxEntry:
    """What `take_for_transfer` hands the sender."""

    transfer_id: str
    block_ids: tuple[int, ...]
    n_tokens: int
    expires_at: float


@dataclass(frozen=True)
class OutboxStats:
    pending: int  # entries held, in flight included
    in_flight: int
    blocks_held: int
    put: int
    done: int
    released: int
    expired: int


class Outbox:
    """Blocks of finished prefills, keyed by transfer id, each under a lease."""

    def __init__(self, free_fn: Callable[[list[int]], None], default_lease_s: float = KVTransferConfig.lease_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s must be positive, got {default_lease_s}")
        self._free_fn = free_fn
        self.default_lease_s = default_lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._fates: OrderedDict[str, str] = OrderedDict()
        self._counts = {"put": 0, "done": 0, "released": 0, "expired": 0}

    # --- producer side ------------------------------------------------------------------------

    def put(self, transfer_id: str, block_ids: list[int], n_tokens: int, lease_s: float | None = None) -> float:
        """Hold ``block_ids`` for ``transfer_id``; returns the lease's expiry on this outbox's clock."""
        lease = self.default_lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise ValueError(f"lease_s must be positive, got {lease}")
        if not block_ids:
            raise ValueError(f"transfer {transfer_id}: no blocks to hold")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"transfer {transfer_id}: duplicate block ids")
        if n_tokens < 1:
            raise ValueError(f"transfer {transfer_id}: n_tokens must be >= 1, got {n_tokens}")
        with self._lock:
            if transfer_id in self._entries:
                raise ValueError(f"transfer {transfer_id} is already in the outbox")
            expires_at = self._clock() + lease
            self._entries[transfer_id] = _Entry(transfer_id, tuple(block_ids), n_tokens, expires_at)
            self._fates.pop(transfer_id, None)
            self._counts["put"] += 1
        return expires_at

    # --- sender side --------------------------------------------------------------------------

    def take_for_transfer(self, transfer_id: str) -> OutboxEntry:
        """Mark the entry in flight (expiry skips it) and return it; refuse with a reason otherwise."""
        freed: list[int] | None = None
        with self._lock:
            e = self._entries.get(transfer_id)
            if e is None:
                fate = self._fates.get(transfer_id)
                why = (f"was already {_FATE_WORDS[fate]}" if fate
                       else "is unknown to this source (never offered, or long gone)")
                raise TransferRefused(f"transfer {transfer_id} {why}")
            if e.in_flight:
                raise TransferRefused(f"transfer {transfer_id} is already being pulled")
            if e.release_requested:
                raise TransferRefused(f"transfer {transfer_id} was released")
            now = self._clock()
            if now >= e.expires_at:
                freed = self._pop(e, "expired")
            else:
                e.in_flight = True
                return OutboxEntry(e.transfer_id, e.block_ids, e.n_tokens, e.expires_at)
        self._free_fn(freed)
        raise TransferRefused(f"transfer {transfer_id} expired {now - e.expires_at:.1f}s ago (lease ran out)")

    def done(self, transfer_id: str) -> bool:
        """The destination has the data: free the blocks. True if this call freed them."""
        return self._finish(transfer_id, "done", require_in_flight=True)

    def requeue(self, transfer_id: str) -> bool:
        """The send failed: the entry goes back under its lease (or is freed now if its time is up or
        it was released meanwhile). True if this call freed the blocks."""
        freed: list[int] | None = None
        with self._lock:
            e = self._entries.get(transfer_id)
            if e is None or not e.in_flight:
                return False
            e.in_flight = False
            if e.release_requested:
                freed = self._pop(e, "released")
            elif self._clock() >= e.expires_at:
                freed = self._pop(e, "expired")
        if freed is None:
            return False
        self._free_fn(freed)
        return True

    # --- lease / abort ------------------------------------------------------------------------

    def release(self, transfer_id: str) -> bool:
        """Give the blocks back without sending. In flight: freed when that transfer ends. True if
        this call freed them."""
        with self._lock:
            e = self._entries.get(transfer_id)
            if e is None:
                return False
            if e.in_flight:
                e.release_requested = True
                return False
            freed = self._pop(e, "released")
        self._free_fn(freed)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Free every pending entry whose lease has run out; returns their ids."""
        batches: list[tuple[str, list[int]]] = []
        with self._lock:
            t = self._clock() if now is None else now
            for e in list(self._entries.values()):
                if not e.in_flight and t >= e.expires_at:
                    batches.append((e.transfer_id, self._pop(e, "expired")))
        for _, blocks in batches:
            self._free_fn(blocks)
        return [tid for tid, _ in batches]

    def release_all(self) -> int:
        """Free every entry not in flight (shutdown); returns how many were freed."""
        with self._lock:
            ids = [e.transfer_id for e in self._entries.values() if not e.in_flight]
        return sum(self.release(tid) for tid in ids)

    # --- introspection ------------------------------------------------------------------------

    def pending(self) -> int:
        with self._lock:
            return len(self._entries)

    def num_blocks_held(self) -> int:
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values())

    def stats(self) -> OutboxStats:
        with self._lock:
            return OutboxStats(pending=len(self._entries),
                               in_flight=sum(e.in_flight for e in self._entries.values()),
                               blocks_held=sum(len(e.block_ids) for e in self._entries.values()),
                               **self._counts)

    def check_empty(self) -> None:
        """Raise AssertionError naming the entries still held (for tests and idle-time checks)."""
        with self._lock:
            if self._entries:
                held = ", ".join(f"{e.transfer_id}({len(e.block_ids)} blocks"
                                 f"{', in flight' if e.in_flight else ''})"
                                 for e in list(self._entries.values())[:10])
                raise AssertionError(f"outbox still holds {len(self._entries)} transfer(s): {held}")

    # --- internals ----------------------------------------------------------------------------

    def _finish(self, transfer_id: str, fate: str, *, require_in_flight: bool) -> bool:
        with self._lock:
            e = self._entries.get(transfer_id)
            if e is None or (require_in_flight and not e.in_flight):
                return False
            freed = self._pop(e, fate)
        self._free_fn(freed)
        return True

    def _pop(self, e: _Entry, fate: str) -> list[int]:
        """Remove ``e`` (lock held) and record its fate; the caller frees the blocks after unlocking."""
        del self._entries[e.transfer_id]
        self._counts[fate] += 1
        self._fates[e.transfer_id] = fate
        while len(self._fates) > _HISTORY:
            self._fates.popitem(last=False)
        return list(e.block_ids)
