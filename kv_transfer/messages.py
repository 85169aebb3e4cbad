"""Control-channel messages: typed, versioned dataclasses ↔ msgpack maps.

The conversation on one connection (``→`` destination to source, ``←`` back); `auth.py` defines
the MACs, `server.py` / `client.py` the behaviour:

    ← CHALLENGE{version, node_id, nonce}              server speaks first
    → HELLO{version, node_id, nonce, timestamp, mac}  client proves it knows the cluster secret
    ← WELCOME{node_id, mac}                           server proves it too (or ERROR{auth}, close)
    once, when the replicas meet (before any PULL; never inside a transfer):
    → PAIR{transport, transport_info}                 the destination's end of the data-plane pair
    ← PAIR_READY{transport_info}                      the source's offer (or ERROR); both open the pair
    then, any number of times, one at a time:
    → PULL{transfer_id, dst_layout, n_blocks, transport, dst_runs}
    ← PULL_READY{transfer_id, n_tokens, n_blocks, nbytes}   (or ERROR; refused without a pair)
      ... data plane: the source sends, the destination receives ...
    → DONE{transfer_id, nbytes, seconds}
    ← ACK{transfer_id}                                the source has freed the blocks
    → RELEASE{transfer_id}
    ← ACK{transfer_id}                                freed (or already gone)

Invariants: every message is a map ``{"v": PROTOCOL_VERSION, "type": <kind>, ...fields}``; decoding
takes at most `MAX_MESSAGE_BYTES`, refuses other versions, unknown kinds, missing/extra fields and
wrong types or ranges, and raises only `CodecError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kv_transfer.errors import CodecError
from kv_transfer.handle import MAX_TOKENS
from kv_transfer.layout import KVLayout
from kv_transfer.transport import TransportInfo
from kv_transfer.wire import ID_RE, NAME_RE, Fields, pack, unpack_map

PROTOCOL_VERSION = 2  # 2: pairs are set up by PAIR when replicas meet, never inside a PULL
MAX_MESSAGE_BYTES = 1 << 20
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_BLOCKS = MAX_TOKENS  # a block holds at least one token
_MAX_BYTES = 1 << 50
_MAX_REASON = 1000  # characters: at most 4 KB of UTF-8, under the decoder's string limit


@dataclass(frozen=True)
class Challenge:
    TYPE: ClassVar[str] = "challenge"
    version: int
    node_id: str
    nonce: bytes


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[str] = "hello"
    version: int
    node_id: str
    nonce: bytes
    timestamp: float  # unix seconds of the client
    mac: bytes


@dataclass(frozen=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    node_id: str
    mac: bytes


@dataclass(frozen=True)
class Pair:
    TYPE: ClassVar[str] = "pair"
    transport: str
    transport_info: TransportInfo  # the destination's end (e.g. its GPU)


@dataclass(frozen=True)
class PairReady:
    TYPE: ClassVar[str] = "pair_ready"
    transport_info: TransportInfo  # the source's offer: both ends open the pair with it


@dataclass(frozen=True)
class Pull:
    TYPE: ClassVar[str] = "pull"
    transfer_id: str
    dst_layout: KVLayout
    n_blocks: int  # what the destination reserved for it: must equal ceil(n_tokens / block_size)
    transport: str
    dst_runs: tuple[int, ...] | None = None  # direct transports: lengths of consecutive-id runs


@dataclass(frozen=True)
class PullReady:
    TYPE: ClassVar[str] = "pull_ready"
    transfer_id: str
    n_tokens: int
    n_blocks: int
    nbytes: int


@dataclass(frozen=True)
class Done:
    TYPE: ClassVar[str] = "done"
    transfer_id: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Release:
    TYPE: ClassVar[str] = "release"
    transfer_id: str


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[str] = "ack"
    transfer_id: str


@dataclass(frozen=True)
class Error:
    """``code``: ``refused`` | ``auth`` | ``bad_request`` | ``busy`` | ``internal``."""

    TYPE: ClassVar[str] = "error"
    code: str
    reason: str

    def __post_init__(self) -> None:
        if len(self.reason) > _MAX_REASON:  # reasons quote peer input and exceptions: keep them decodable
            object.__setattr__(self, "reason", self.reason[: _MAX_REASON - 3] + "...")


Message = Challenge | Hello | Welcome | Pair | PairReady | Pull | PullReady | Done | Release | Ack | Error


def encode_message(msg: Message) -> bytes:
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for key, value in vars(msg).items():
        if isinstance(value, (KVLayout, TransportInfo)):
            value = value.to_wire()
        elif isinstance(value, tuple):
            value = list(value)
        body[key] = value
    out = pack(body)
    if len(out) > MAX_MESSAGE_BYTES:
        raise CodecError(f"{msg.TYPE}: {len(out)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    return out


def decode_message(data: bytes) -> Message:
    f = unpack_map(data, max_bytes=MAX_MESSAGE_BYTES, what="message")
    version = f.get_int("v", lo=0, hi=1 << 31)
    if version != PROTOCOL_VERSION:
        raise CodecError(f"message: unsupported protocol version {version} (this build speaks "
                         f"{PROTOCOL_VERSION})")
    kind = f.get_str("type", pattern=NAME_RE, max_len=32)
    parse = _PARSERS.get(kind)
    if parse is None:
        raise CodecError(f"message: unknown type {kind!r}")
    f.what = kind
    msg = parse(f)
    f.finish()
    return msg


def _id(f: Fields, key: str = "transfer_id") -> str:
    return f.get_str(key, pattern=ID_RE, max_len=128)


def _count(f: Fields, key: str, hi: int) -> int:
    return f.get_int(key, lo=1, hi=hi)


def _layout(f: Fields, key: str) -> KVLayout:
    try:
        return KVLayout.from_wire(f.get_map(key))
    except CodecError:
        raise
    except ValueError as e:
        raise CodecError(f"{f.what}.{key}: {e}") from None


def _parse_pull(f: Fields) -> Pull:
    runs = None if f.is_nil("dst_runs") else f.get_ints("dst_runs", lo=1, hi=MAX_BLOCKS, max_len=65536)
    msg = Pull(transfer_id=_id(f), dst_layout=_layout(f, "dst_layout"),
               n_blocks=_count(f, "n_blocks", MAX_BLOCKS),
               transport=f.get_str("transport", pattern=NAME_RE, max_len=64), dst_runs=runs)
    if runs is not None and sum(runs) != msg.n_blocks:
        raise CodecError(f"pull: dst_runs sum to {sum(runs)}, not n_blocks={msg.n_blocks}")
    return msg


def _parse_pull_ready(f: Fields) -> PullReady:
    return PullReady(transfer_id=_id(f), n_tokens=_count(f, "n_tokens", MAX_TOKENS),
                     n_blocks=_count(f, "n_blocks", MAX_BLOCKS), nbytes=_count(f, "nbytes", _MAX_BYTES))


_PARSERS: dict[str, Callable[[Fields], Message]] = {
    "challenge": lambda f: Challenge(version=f.get_int("version", lo=1, hi=1 << 31), node_id=_id(f, "node_id"),
                                     nonce=f.get_bytes("nonce", min_len=NONCE_BYTES, max_len=NONCE_BYTES)),
    "hello": lambda f: Hello(version=f.get_int("version", lo=1, hi=1 << 31), node_id=_id(f, "node_id"),
                             nonce=f.get_bytes("nonce", min_len=NONCE_BYTES, max_len=NONCE_BYTES),
                             timestamp=f.get_float("timestamp", lo=0.0, hi=1e11),
                             mac=f.get_bytes("mac", min_len=MAC_BYTES, max_len=MAC_BYTES)),
    "welcome": lambda f: Welcome(node_id=_id(f, "node_id"),
                                 mac=f.get_bytes("mac", min_len=MAC_BYTES, max_len=MAC_BYTES)),
    "pair": lambda f: Pair(transport=f.get_str("transport", pattern=NAME_RE, max_len=64),
                           transport_info=TransportInfo.from_wire(f.get_map("transport_info"))),
    "pair_ready": lambda f: PairReady(transport_info=TransportInfo.from_wire(f.get_map("transport_info"))),
    "pull": _parse_pull,
    "pull_ready": _parse_pull_ready,
    "done": lambda f: Done(transfer_id=_id(f), nbytes=f.get_int("nbytes", lo=0, hi=_MAX_BYTES),
                           seconds=f.get_float("seconds", lo=0.0, hi=1e9)),
    "release": lambda f: Release(transfer_id=_id(f)),
    "ack": lambda f: Ack(transfer_id=_id(f)),
    "error": lambda f: Error(code=f.get_str("code", pattern=NAME_RE, max_len=32),
                             reason=f.get_str("reason", max_len=_MAX_REASON)),
}
