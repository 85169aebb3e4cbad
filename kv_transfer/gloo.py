"""`GlooTransport` (``gloo``): the CPU data plane, one `ProcessGroupGloo` of two ranks per pair.

Owns: the per-pair rendezvous and process group. No `init_process_group`: the group is constructed
directly (``ProcessGroupGloo(PrefixStore(prefix, store), rank, 2, options)``), so any number of
pairs live side by side in one process and none touches torch's global default group.

Who hosts the TCPStore: the **source**. `offer` binds a listening socket on the source's own
data-plane address (never all interfaces: the socket is made here and handed to the store with
``master_listen_fd``) on a free port, starts a `TCPStore` server on it, and advertises
``host:port`` plus a random 128-bit pair token in PULL_READY over the authenticated control channel.
The destination connects to that store as a client. Keys live under ``pdserve-kv/<token hex>/``.
One store per pair, owned by the pair: closing the pair closes the store, so a dead peer leaves no
keys, ports or threads behind.

Invariants: rank 0 = source, rank 1 = destination; gloo devices bind to each side's configured
``host``; tensors travel as their raw bytes (``uint8`` views), so every dtype arrives bit-exact;
every wait carries a deadline (``Work.wait(timeout)``), so a worker thread never outlives it; a
size header precedes the data, because gloo *aborts the process* (not just the op) when a message
is larger than the receive posted for it.

Security note: the store and gloo's own sockets are not authenticated; the pair token is only
learned through the HMAC-authenticated control channel, and both bind to the cluster network only.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.errors import TransferError, TransferTimeout
from kv_transfer.transport import (
    SOURCE_RANK,
    ChunkSink,
    ChunkSource,
    KVTransport,
    TransportInfo,
    check_contiguous,
)

_PREFIX = "pdserve-kv"
_PEER = {0: 1, 1: 0}


class GlooTransport(KVTransport):
    """One end of a gloo pair; blocking calls are meant for a worker thread, never an event loop."""

    name = "gloo"

    def __init__(self, rank: int, *, host: str, timeout_s: float) -> None:
        super().__init__(rank, host=host, timeout_s=timeout_s)
        self._store: dist.Store | None = None
        self._pg: Any = None  # dist.ProcessGroupGloo; its p2p methods are missing from the stubs
        self._broken = False

    def offer(self, peer: TransportInfo) -> TransportInfo:
        if self.rank != SOURCE_RANK:
            raise TransferError("gloo: only the source (rank 0) makes an offer")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.listen(16)
            port = sock.getsockname()[1]
            # The store takes ownership of the fd (and closes it when it is destroyed).
            self._store = dist.TCPStore(self.host, port, None, True, _td(self.timeout_s),
                                        wait_for_workers=False, master_listen_fd=sock.detach())
        finally:
            sock.close()  # a no-op after detach; closes the socket if binding failed
        return TransportInfo(name=self.name, host=self.host, port=port, token=secrets.token_bytes(16))

    def open(self, offer: TransportInfo, timeout_s: float) -> None:
        if self._pg is not None:
            raise TransferError("gloo: pair already open")
        if len(offer.token) < 16 or not offer.host or not offer.port:
            raise TransferError(f"gloo: incomplete offer {offer.host}:{offer.port}")
        try:
            if self.rank != SOURCE_RANK:
                self._store = dist.TCPStore(offer.host, offer.port, None, False, _td(timeout_s))
            assert self._store is not None, "source must offer before it opens"
            store = dist.PrefixStore(f"{_PREFIX}/{offer.token.hex()}", self._store)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            opts._timeout = _td(timeout_s)  # bounds the rendezvous; every op passes its own timeout
            self._pg = dist.ProcessGroupGloo(store, self.rank, 2, opts)
        except Exception as e:
            self.close()
            raise _wrap(e, f"gloo: connecting the pair via {offer.host}:{offer.port}") from None

    def _group(self) -> Any:
        if self._pg is None or self._broken:
            raise TransferError("gloo: pair is not open")
        return self._pg

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        check_contiguous(tensors, "gloo send")
        self._run("send", tensors, timeout_s)

    def recv(self, into: Sequence[torch.Tensor], timeout_s: float) -> None:
        check_contiguous(into, "gloo recv")
        self._run("recv", into, timeout_s)

    def _run(self, op: str, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        pg, peer, wait = self._group(), _PEER[self.rank], self._waiter(op, timeout_s)
        try:
            # Gloo aborts the whole process when a message is larger than the posted receive, so a
            # fixed-size header (tag 0) goes first, and the receiver posts the data receives only if
            # it matches exactly; a mismatched sender then just times out. Raw bytes: gloo never sees
            # (or converts) the dtype. Ops on a pair are serialized, so tags repeat across transfers.
            header = _header(tensors)
            if op == "send":
                works = [pg.send([header], peer, 0)]
                works += [pg.send([_bytes(t)], peer, tag) for tag, t in enumerate(tensors, start=1)]
            else:
                theirs = torch.empty_like(header)
                wait(pg.recv([theirs], peer, 0))
                _check_header(theirs, header)
                works = [pg.recv([_bytes(t)], peer, tag) for tag, t in enumerate(tensors, start=1)]
            for w in works:
                wait(w)
        except Exception as e:
            self._broken = True
            raise _wrap(e, f"gloo: {op} of {len(tensors)} tensor(s)") from None

    def send_stream(self, stream: ChunkSource, timeout_s: float) -> None:
        """Fill chunk i+1 while gloo's I/O thread sends chunk i; a slot is refilled only after its
        previous chunk's send completed."""
        pg, peer, wait = self._group(), _PEER[self.rank], self._waiter("send", timeout_s)
        try:
            header = _header([stream.buffer(i) for i in range(stream.count)])
            pending = {-1: pg.send([header], peer, 0)}
            for i in range(stream.count):
                if i >= stream.window:
                    wait(pending.pop(i - stream.window))
                stream.fill(i)
                pending[i] = pg.send([_bytes(stream.buffer(i))], peer, 1 + i)
            for w in pending.values():
                wait(w)
        except Exception as e:
            self._broken = True
            raise _wrap(e, f"gloo: streaming {stream.count} chunk(s)") from None

    def recv_stream(self, stream: ChunkSink, timeout_s: float) -> None:
        """Keep ``window`` receives posted; drain chunk i while chunks i+1.. arrive."""
        pg, peer, wait = self._group(), _PEER[self.rank], self._waiter("recv", timeout_s)
        try:
            header = _header([stream.buffer(i) for i in range(stream.count)])
            theirs = torch.empty_like(header)
            wait(pg.recv([theirs], peer, 0))
            _check_header(theirs, header)
            posted = {i: pg.recv([_bytes(stream.buffer(i))], peer, 1 + i)
                      for i in range(min(stream.window, stream.count))}
            for i in range(stream.count):
                wait(posted.pop(i))
                stream.drain(i)
                if i + stream.window < stream.count:
                    j = i + stream.window
                    posted[j] = pg.recv([_bytes(stream.buffer(j))], peer, 1 + j)
        except Exception as e:
            self._broken = True
            raise _wrap(e, f"gloo: receiving a stream of {stream.count} chunk(s)") from None

    def _waiter(self, op: str, timeout_s: float) -> Callable[[Any], None]:
        deadline = time.monotonic() + timeout_s

        def wait(w: Any) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"gloo: {op} timed out after {timeout_s:.1f}s")
            w.wait(_td(left))

        return wait

    def close(self) -> None:
        # Dropping the references destroys the group (and its sockets) and the store; a worker
        # thread still inside a wait holds its own reference, so memory stays valid until it ends.
        self._broken = True
        self._pg = None
        self._store = None

    @property
    def is_open(self) -> bool:
        return self._pg is not None and not self._broken


def _header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[count, total bytes, digest of the sizes]``: what both ends must agree on before any data op."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    digest = 0
    for n in sizes:
        digest = (digest * 1_000_003 + n) % (1 << 61)
    return torch.tensor([len(sizes), sum(sizes), digest], dtype=torch.int64)


def _check_header(theirs: torch.Tensor, ours: torch.Tensor) -> None:
    if not torch.equal(theirs, ours):
        raise TransferError(f"gloo: sender announced {theirs.tolist()} (tensors, bytes, digest), "
                            f"receiver expects {ours.tolist()}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _wrap(e: Exception, what: str) -> TransferError:
    if isinstance(e, TransferError):
        return e
    msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if "timed out" in msg.lower() or "timeout" in msg.lower():
        return TransferTimeout(f"{what}: {msg}")
    return TransferError(f"{what}: {msg}")
