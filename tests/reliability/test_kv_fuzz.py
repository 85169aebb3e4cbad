"""Fuzzing the KV control channel from another process, and the handle codec, with hypothesis.

A real `KVSource` runs in a child process (tight timeouts: 2 s handshake, 32 connections); this
process is the attacker. It connects over TCP and sends garbage before and after the challenge,
partial frames, frames that declare huge lengths, forged and replayed HELLOs, and after a real
handshake, forged PULLs (unknown ids, a real id with the wrong size or layout) and garbage frames.
Each peer must get an ``Error`` frame and/or a closed connection within the timeouts, never a
WELCOME without the secret; after all of it a legitimate puller in a third process still pulls
byte-identical KV, the outbox ends empty, and the source's memory stayed within what its limits
allow (frames over the maximum are refused from the 4-byte length, before any body is read).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket
import struct
import time
from collections.abc import Iterator

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.auth import make_hello
from kv_transfer.errors import CodecError
from kv_transfer.handle import KVHandle, decode_handle, encode_handle
from kv_transfer.layout import KVLayout
from kv_transfer.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Challenge,
    Done,
    Error,
    Hello,
    Message,
    Pull,
    Release,
    Welcome,
    decode_message,
    encode_message,
)
from kv_transfer.server import MAX_HELLO_BYTES, SourceConfig
from kv_transfer.wire import pack
from tests.support.kv_caches import SECRET
from tests.support.kv_procs import GetStats, Offer, Offered, Proc, PullAll, SourceReport, dest_main, source_main

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

LAYOUT = KVLayout(arch="llama", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
# long enough that a peer on two busy cores always answers inside it (only the silent-peer test waits it out)
HANDSHAKE_S = 5.0
MAX_CONNECTIONS = 32
CONFIG = SourceConfig(host="127.0.0.1", handshake_timeout_s=HANDSHAKE_S, io_timeout_s=2.0, idle_timeout_s=4.0,
                      transfer_timeout_s=10.0, max_connections=MAX_CONNECTIONS)
HEADER = struct.Struct(">I")
# derandomized: CI runs the same examples every time (a failure reproduces); no example database
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
EOF = "EOF"


@dataclasses.dataclass
class Procs:
    source: Proc
    dest: Proc
    address: tuple[str, int]

    def rss(self) -> int:
        return int(psutil.Process(self.source.proc.pid).memory_info().rss)

    def stats(self) -> SourceReport:
        report = self.source.call(GetStats(), timeout_s=30)
        assert isinstance(report, SourceReport)
        return report


@pytest.fixture(scope="module")
def procs() -> Iterator[Procs]:
    started: list[Proc] = []
    try:
        source = Proc(source_main, LAYOUT, 128, 7, CONFIG, 60.0, logging.ERROR)  # quiet: a warning per bad peer
        started.append(source)
        dest = Proc(dest_main, LAYOUT, 128)
        started.append(dest)
        source.ready()
        dest.ready()
        assert source.address is not None
        yield Procs(source, dest, source.address)
    finally:
        for p in started:
            p.stop()


def legit_pull(p: Procs, n: int = 2) -> None:
    """A real puller (third process) pulls fresh handles byte-identically."""
    offers = p.source.call(Offer(40, n))
    outcomes = p.dest.call(PullAll(tuple(o.handle for o in offers), timeout_s=20), timeout_s=40)
    for o, r in zip(offers, outcomes, strict=True):
        assert r.error is None, f"{r.error}: {r.message}"
        assert r.digest == o.digest


# ---- a blocking peer -----------------------------------------------------------------------------


class Peer:
    """One TCP connection to the source, speaking frames by hand."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 5.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *_: object) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:  # the source may already have hung up on us: that is an allowed answer
            pass

    def send(self, msg: Message) -> None:
        body = encode_message(msg)
        self.send_raw(HEADER.pack(len(body)) + body)

    def recv(self, timeout_s: float = 5.0) -> Message | str:
        """The next message, or ``EOF``; raises TimeoutError if the source says nothing in time."""
        self.sock.settimeout(timeout_s)
        header = self._exactly(HEADER.size)
        if header is None:
            return EOF
        body = self._exactly(HEADER.unpack(header)[0])
        return EOF if body is None else decode_message(body)

    def replies(self, timeout_s: float) -> list[Message | str]:
        """Everything until the source closes the connection (which it must do within ``timeout_s``)."""
        out: list[Message | str] = []
        deadline = time.monotonic() + timeout_s
        while not out or out[-1] != EOF:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the source kept the connection open past {timeout_s} s: {out}")
            out.append(self.recv(left))
        return out

    def handshake(self, secret: bytes = SECRET) -> tuple[Challenge, Hello, Message | str]:
        challenge = self.recv()
        assert isinstance(challenge, Challenge), challenge
        hello = make_hello(secret, "fuzzer", challenge)
        self.send(hello)
        return challenge, hello, self.recv()

    def _exactly(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)


def errors(replies: list[Message | str]) -> list[Error]:
    return [m for m in replies if isinstance(m, Error)]


# ---- before authentication -----------------------------------------------------------------------


@FUZZ
@given(data=st.binary(min_size=1, max_size=3000), after_challenge=st.booleans())
def test_garbage_gets_an_error_or_a_close_never_a_welcome(procs: Procs, data: bytes, after_challenge: bool) -> None:
    with Peer(procs.address) as peer:
        if after_challenge:
            assert isinstance(peer.recv(), Challenge)
        peer.send_raw(data)
        peer.sock.shutdown(socket.SHUT_WR)  # then EOF: the source must not wait for more
        replies = peer.replies(HANDSHAKE_S + 3)
    assert not any(isinstance(m, Welcome) for m in replies), replies
    assert all(isinstance(m, (Challenge, Error)) or m == EOF for m in replies), replies


@pytest.mark.parametrize("stall", [b"", b"\x00\x00", HEADER.pack(100) + b"x" * 10])
def test_a_silent_or_partial_peer_is_dropped_at_the_handshake_timeout(procs: Procs, stall: bytes) -> None:
    t0 = time.monotonic()
    with Peer(procs.address) as peer:
        assert isinstance(peer.recv(), Challenge)
        peer.send_raw(stall)
        replies = peer.replies(HANDSHAKE_S + 5)
    took = time.monotonic() - t0
    assert replies[-1] == EOF and HANDSHAKE_S - 0.5 <= took <= HANDSHAKE_S + 5, (replies, took)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.one_of(st.just(0), st.integers(MAX_MESSAGE_BYTES + 1, 2**32 - 1)))
def test_huge_declared_lengths_are_refused_before_reading(procs: Procs, n: int) -> None:
    with Peer(procs.address) as peer:
        assert isinstance(peer.recv(), Challenge)
        peer.send_raw(HEADER.pack(n))  # and not one byte of the body it announces
        replies = peer.replies(HANDSHAKE_S + 3)
    errs = errors(replies)
    # refused on the header: a source that waited for the body would drop the peer at the handshake
    # timeout, with no bad_request
    assert errs and errs[0].code == "bad_request" and "frame declares" in errs[0].reason, replies


_ids = st.from_regex(r"[A-Za-z0-9._:\-]{1,40}", fullmatch=True)


@st.composite
def forged_hellos(draw: st.DrawFn, challenge: Challenge) -> Hello:
    """A HELLO that must not pass: wrong secret, a MAC over another challenge, garbage, or a stale clock."""
    kind = draw(st.sampled_from(["wrong_secret", "other_nonce", "random_mac", "stale", "version", "tampered"]))
    node_id = draw(_ids)
    if kind == "wrong_secret":
        secret = draw(st.binary(min_size=16, max_size=64).filter(lambda s: s != SECRET))
        return make_hello(secret, node_id, challenge)
    if kind == "other_nonce":
        other = dataclasses.replace(challenge, nonce=draw(st.binary(min_size=32, max_size=32)))
        return make_hello(SECRET, node_id, other)
    if kind == "stale":
        skew = draw(st.floats(400, 1e6)) * draw(st.sampled_from([-1, 1]))
        return make_hello(SECRET, node_id, challenge, now=max(0.0, time.time() + skew))
    good = make_hello(SECRET, node_id, challenge)
    if kind == "random_mac":
        return dataclasses.replace(good, mac=draw(st.binary(min_size=32, max_size=32)))
    if kind == "version":
        return dataclasses.replace(good, version=draw(st.integers(2, 1 << 20)))
    return dataclasses.replace(good, node_id=node_id + "x")  # signed for another client id


@FUZZ
@given(data=st.data())
def test_forged_hellos_are_refused(procs: Procs, data: st.DataObject) -> None:
    with Peer(procs.address) as peer:
        challenge = peer.recv()
        assert isinstance(challenge, Challenge)
        peer.send(data.draw(forged_hellos(challenge)))
        replies = peer.replies(HANDSHAKE_S + 3)
    errs = errors(replies)
    assert errs and errs[0].code == "auth" and not any(isinstance(m, Welcome) for m in replies), replies


def test_a_replayed_hello_is_refused_on_a_new_connection(procs: Procs) -> None:
    before = procs.stats().stats.auth_failures
    with Peer(procs.address) as first:
        _, hello, welcome = first.handshake()
        assert isinstance(welcome, Welcome)
        with Peer(procs.address) as second:
            assert isinstance(second.recv(), Challenge)
            second.send(hello)  # recorded from the first connection: bound to its challenge
            replies = second.replies(HANDSHAKE_S + 3)
    assert errors(replies)[0].code == "auth"
    assert procs.stats().stats.auth_failures == before + 1


# ---- after authentication ------------------------------------------------------------------------


def _pull(tid: str, n_blocks: int, layout: KVLayout = LAYOUT) -> Pull:
    return Pull(tid, layout, n_blocks, "gloo")


_junk_values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20))
_forged = st.one_of(
    st.tuples(st.just("unknown_id"), _ids, st.integers(1, 1 << 20)),
    st.tuples(st.just("wrong_blocks"), st.integers(1, 1 << 20).filter(lambda n: n != 3)),
    st.tuples(st.just("wrong_layout"), st.integers(3, 64)),
    st.tuples(st.just("release_unknown"), _ids),
    st.tuples(st.just("unexpected"), st.sampled_from(["done", "ack", "welcome"])),
    st.tuples(st.just("junk_frame"), st.binary(min_size=1, max_size=2000)),
    st.tuples(st.just("junk_map"), st.dictionaries(st.text(max_size=12), _junk_values, max_size=8)),
)
_REFUSED = ("unknown_id", "wrong_blocks", "wrong_layout")


@FUZZ
@given(forged=_forged)
def test_forged_requests_after_a_real_handshake(procs: Procs, forged: tuple[object, ...]) -> None:
    """Unknown ids and wrong sizes are refused and leave the connection usable; junk closes it.

    Everything is drawn before the real handle is offered, so no example can end half-way and
    leave it in the outbox.
    """
    kind, arg = str(forged[0]), forged[1]
    real: Offered = procs.source.call(Offer(40))[0]
    tid = real.handle.transfer_id
    with Peer(procs.address) as peer:
        assert isinstance(peer.handshake()[2], Welcome)
        if kind == "unknown_id":
            peer.send(_pull(str(arg), int(forged[2])))  # type: ignore[call-overload]
        elif kind == "wrong_blocks":
            peer.send(_pull(tid, int(arg)))  # type: ignore[call-overload]
        elif kind == "wrong_layout":
            peer.send(_pull(tid, 3, dataclasses.replace(LAYOUT, num_layers=int(arg))))  # type: ignore[call-overload]
        elif kind == "release_unknown":
            peer.send(Release(str(arg)))
        elif kind == "unexpected":
            unexpected: dict[str, Message] = {"done": Done(tid, 1, 0.1), "ack": Ack("x"),
                                              "welcome": Welcome("x", b"\x00" * 32)}
            peer.send(unexpected[str(arg)])
        else:
            body = arg if kind == "junk_frame" else pack({"v": PROTOCOL_VERSION, "type": "pull", **arg})  # type: ignore[dict-item]
            assert isinstance(body, bytes)
            peer.send_raw(HEADER.pack(len(body)) + body)
        reply = peer.recv(HANDSHAKE_S + 3)
        if kind in _REFUSED or kind == "release_unknown":
            if kind in _REFUSED:
                assert isinstance(reply, Error) and reply.code == "refused", reply
            else:
                assert isinstance(reply, Ack), reply
            peer.send(Release(tid))  # the connection still works: free the real handle on it
            assert isinstance(peer.recv(), Ack)
        else:
            assert isinstance(reply, Error) and reply.code == "bad_request", reply
            assert peer.replies(HANDSHAKE_S + 3)[-1] == EOF
    if kind not in _REFUSED and kind != "release_unknown":
        # the forged request never touched the real handle: it is still pullable, byte for byte
        outcome = procs.dest.call(PullAll((real.handle,), timeout_s=20), timeout_s=40)[0]
        assert outcome.error is None and outcome.digest == real.digest, outcome


def test_connection_limit_and_memory_stay_bounded(procs: Procs) -> None:
    """Past max_connections a peer is told 'busy'; floods of huge or max-size frames cost bounded memory."""
    rss0 = procs.rss()
    held = procs.stats().stats.connections  # the legitimate puller's cached connection
    peers = [Peer(procs.address) for _ in range(MAX_CONNECTIONS - held)]
    try:
        for p in peers:
            assert isinstance(p.recv(), Challenge)
        with Peer(procs.address) as extra:
            replies = extra.replies(HANDSHAKE_S + 3)
        assert errors(replies) and errors(replies)[0].code == "busy", replies
    finally:
        for p in peers:
            p.sock.close()
    time.sleep(0.5)
    # 300 peers each announcing a frame of up to 4 GiB: refused from the header alone
    for i in range(300):
        with Peer(procs.address) as p:
            p.recv()
            p.send_raw(HEADER.pack(MAX_MESSAGE_BYTES + 1 + i * 14_000_000))
            p.replies(HANDSHAKE_S + 3)
    rss_huge = procs.rss()
    # before authenticating, a peer may not make the source buffer more than a HELLO-sized frame:
    # 24 peers each announcing a maximum-size frame are refused from the header
    for i in range(24):
        with Peer(procs.address) as p:
            p.recv()
            p.send_raw(HEADER.pack(MAX_HELLO_BYTES + 1 + i) + b"\x00" * 1000)
            errs = errors(p.replies(HANDSHAKE_S + 3))
            assert errs and "frame declares" in errs[0].reason
    # 24 authenticated peers each sending all but the last byte of a maximum-size frame, then stalling
    stalled = [Peer(procs.address) for _ in range(24)]
    try:
        for p in stalled:
            assert isinstance(p.handshake()[2], Welcome)
            p.send_raw(HEADER.pack(MAX_MESSAGE_BYTES) + b"\x00" * (MAX_MESSAGE_BYTES - 1))
        time.sleep(0.5)
        rss_peak = procs.rss()
        for p in stalled:
            assert p.replies(CONFIG.idle_timeout_s + 5)[-1] == EOF  # dropped at the idle timeout
    finally:
        for p in stalled:
            p.sock.close()
    mib = 1 << 20
    print(f"source RSS: {rss0 / mib:.1f} MiB at start, {rss_huge / mib:.1f} after 300 frames declaring up to "
          f"4 GiB, {rss_peak / mib:.1f} with 24 authenticated max-size frames half-read "
          f"(limit {MAX_MESSAGE_BYTES // mib} MiB each)")
    assert rss_huge - rss0 < 16 * mib
    assert rss_peak - rss0 < 24 * MAX_MESSAGE_BYTES + 32 * mib


def test_the_source_still_serves_and_its_books_are_whole(procs: Procs) -> None:
    legit_pull(procs, 4)
    report = procs.stats()
    print(f"after fuzzing: auth failures {report.stats.auth_failures}, refused {report.stats.refused}, "
          f"transfers {report.stats.transfers}")
    assert report.leftovers is None, report.leftovers
    assert report.free_blocks == 128
    assert report.stats.auth_failures >= 40


# ---- the handle codec --------------------------------------------------------------------------

HANDLE = KVHandle("req-1-abc", "127.0.0.1", 40000, 123, LAYOUT, 1.9e9)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(encode_handle(HANDLE))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "replace_value"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            data = data[: draw(st.integers(0, len(data)))]
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            fields = msgpack.unpackb(bytes(encode_handle(HANDLE)), raw=False)
            key = draw(st.sampled_from(sorted(fields)))
            ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
            fields[key] = draw(st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=300),
                                         st.binary(max_size=300), st.lists(ints, max_size=5)))
            data = bytearray(msgpack.packb(fields, use_bin_type=True))
    return bytes(data)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=mutated())
def test_mutated_handles_are_refused_or_valid(data: bytes) -> None:
    """Only CodecError, whatever the bytes; what does decode is a valid handle that round-trips."""
    try:
        h = decode_handle(data)
    except CodecError:
        return
    assert decode_handle(encode_handle(h)) == h
    assert h.n_tokens >= 1 and 0 < h.source_port < 65536 and isinstance(h.layout, KVLayout)


@dataclasses.dataclass
class _ForgedHandle:
    """Pickles exactly as a `KVHandle` does (``decode_handle(<bytes>)``), with bytes of our choosing."""

    wire: bytes

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return (decode_handle, (self.wire,))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(data=mutated())
def test_forged_pickled_handles_fail_in_the_codec(data: bytes) -> None:
    """A handle crosses Ray as a pickle that calls decode_handle: a forged one fails there, typed."""
    assert pickle.loads(pickle.dumps(HANDLE)) == HANDLE
    try:
        h = pickle.loads(pickle.dumps(_ForgedHandle(data)))
    except CodecError:
        return
    assert isinstance(h, KVHandle) and decode_handle(encode_handle(h)) == h


def test_hmac_compare_is_constant_time_by_construction() -> None:
    """The MAC checks use hmac.compare_digest (not ==): verified against auth.py's source."""
    import inspect

    from kv_transfer import auth

    src = inspect.getsource(auth)
    assert src.count("hmac.compare_digest(") == 2 and "mac ==" not in src and "== hello.mac" not in src
    assert "hashlib.sha256" in src
