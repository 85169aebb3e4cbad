"""KVHandle / KVLayout codec and control-message codec: round trips, and every rejection is a CodecError."""

from __future__ import annotations

import pickle
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import MissingDependencyError
from engine.kv_cache import KVCache
from engine.model.config import ModelConfig
from kv_transfer.errors import CodecError, TransferRefused
from kv_transfer.handle import MAX_HANDLE_BYTES, KVHandle, decode_handle, encode_handle
from kv_transfer.layout import KVLayout
from kv_transfer.messages import (
    Ack,
    Challenge,
    Done,
    Error,
    Hello,
    Pair,
    PairReady,
    Pull,
    PullReady,
    Release,
    Welcome,
    decode_message,
    encode_message,
)
from kv_transfer.transport import TransportInfo

SMOL = KVLayout(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)


def handle(**kw: object) -> KVHandle:
    base: dict[str, object] = dict(transfer_id="req-1-abc", source_host="10.0.0.7", source_port=45001,
                                   n_tokens=1000, layout=SMOL, expires_at=1_700_000_030.5)
    base.update(kw)
    return KVHandle(**base)  # type: ignore[arg-type]


def wire(**overrides: object) -> bytes:
    d = msgpack.unpackb(encode_handle(handle()))
    for k, v in overrides.items():
        if v is ...:
            d.pop(k)
        else:
            d[k] = v
    return msgpack.packb(d, use_bin_type=True)


def test_handle_round_trip_and_pickle() -> None:
    h = handle()
    assert decode_handle(encode_handle(h)) == h
    assert pickle.loads(pickle.dumps(h)) == h
    assert h.n_blocks == 63 and h.nbytes == 63 * 737_280
    assert SMOL.block_nbytes * 1000 // 16 == 46_080 * 1000  # docs/architecture.md: 46,080 B/token in fp32


def test_layout_from_cache_and_model() -> None:
    cfg = ModelConfig(family="llama", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False)
    assert KVLayout.from_model(cfg, "fp32", 16) == SMOL
    import torch

    cache = KVCache.allocate(cfg, num_blocks=4, block_size=16, dtype=torch.float32)
    assert KVLayout.from_cache(cache, "llama") == SMOL
    assert SMOL.block_nbytes == cache.block_nbytes
    assert KVLayout.from_model(cfg, torch.bfloat16, 16).dtype == "bfloat16"


def test_layout_mismatch_names_fields() -> None:
    other = KVLayout(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_size=32)
    with pytest.raises(TransferRefused) as ei:
        SMOL.check_compatible(other)
    assert ei.value.fields == ("dtype", "block_size")
    assert "dtype" in ei.value.reason and "block_size" in ei.value.reason
    SMOL.check_compatible(KVLayout(**SMOL.to_wire()))


@pytest.mark.parametrize("bad", [
    dict(v=2), dict(v="1"), dict(v=...), dict(transfer_id=""), dict(transfer_id="x" * 129),
    dict(transfer_id="a b"), dict(transfer_id=7), dict(source_port=0), dict(source_port=65536),
    dict(source_port=True), dict(source_port=-1), dict(n_tokens=0), dict(n_tokens=-5), dict(n_tokens=1.0),
    dict(n_tokens=1 << 40), dict(source_host=""), dict(source_host="h\x00st"), dict(expires_at=float("nan")),
    dict(expires_at=-1.0), dict(expires_at="soon"), dict(layout=...), dict(layout=[1, 2]),
    dict(layout={**SMOL.to_wire(), "dtype": "int8"}), dict(layout={**SMOL.to_wire(), "num_layers": -1}),
    dict(layout={**SMOL.to_wire(), "block_size": 0}), dict(layout={**SMOL.to_wire(), "extra": 1}),
    dict(extra="field"),
])
def test_handle_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(CodecError):
        decode_handle(wire(**bad))


@pytest.mark.parametrize("data", [b"", b"\x00", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([1, 2]),
                                  msgpack.packb({1: 2}), b"\xdf\xff\xff\xff\xff", b"x" * (MAX_HANDLE_BYTES + 1)])
def test_handle_rejects_garbage(data: bytes) -> None:
    with pytest.raises(CodecError):
        decode_handle(data)


def test_handle_rejects_non_bytes() -> None:
    with pytest.raises(CodecError):
        decode_handle("not bytes")  # type: ignore[arg-type]


def test_handle_constructor_validates() -> None:
    with pytest.raises(ValueError):
        handle(source_port=70000)
    with pytest.raises(ValueError):
        handle(n_tokens=0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_only_codec_error(data: bytes) -> None:
    for decode in (decode_handle, decode_message):
        try:
            decode(data)
        except CodecError:
            pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "type", "transfer_id", "source_host", "source_port", "n_tokens",
                                        "layout", "expires_at", "dst_layout", "n_blocks", "transport",
                                        "transport_info", "dst_runs", "nonce", "mac", "code", "reason"]),
                       json_like, max_size=10))
def test_random_maps_only_codec_error(d: dict[str, object]) -> None:
    data = msgpack.packb(d, use_bin_type=True)
    for decode in (decode_handle, decode_message):
        try:
            decode(data)
        except CodecError:
            pass


INFO = TransportInfo(name="gloo", host="10.0.0.7", port=40000, token=b"\x01" * 16)
MESSAGES = [
    Challenge(version=1, node_id="prefill-a", nonce=b"n" * 32),
    Hello(version=1, node_id="decode-b", nonce=b"m" * 32, timestamp=1.7e9, mac=b"x" * 32),
    Welcome(node_id="prefill-a", mac=b"y" * 32),
    Pull(transfer_id="t1", dst_layout=SMOL, n_blocks=63, transport="gloo"),
    Pull(transfer_id="t1", dst_layout=SMOL, n_blocks=63, transport="local-direct", dst_runs=(60, 3)),
    PullReady(transfer_id="t1", n_tokens=1000, n_blocks=63, nbytes=63 * 737_280),
    PullReady(transfer_id="t1", n_tokens=1000, n_blocks=63, nbytes=1),
    Pair(transport="gloo", transport_info=INFO),
    Pair(transport="nccl", transport_info=TransportInfo(name="nccl", device="boot/0000:3b:00.0")),
    PairReady(transport_info=TransportInfo(name="nccl", token=bytes(range(128)), device="boot/0000:3b:00.0")),
    Done(transfer_id="t1", nbytes=123, seconds=0.25),
    Release(transfer_id="t1"),
    Ack(transfer_id="t1"),
    Error(code="refused", reason="KV layout mismatch (dtype: 'float32' vs 'bfloat16')"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_message_round_trip(msg: object) -> None:
    assert decode_message(encode_message(msg)) == msg  # type: ignore[arg-type]


def _msg_wire(msg: object, **overrides: object) -> bytes:
    d = msgpack.unpackb(encode_message(msg))  # type: ignore[arg-type]
    d.update(overrides)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("bad", [
    dict(v=0), dict(type="launch_missiles"), dict(type=3), dict(n_blocks=0), dict(n_blocks=-1),
    dict(dst_runs=[30, 30]), dict(dst_runs=[0, 63]), dict(transport=""), dict(transport_info=INFO.to_wire()),
    dict(dst_layout={"arch": "llama"}), dict(transfer_id=None), dict(unexpected=1),
])
def test_pull_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(CodecError):
        decode_message(_msg_wire(MESSAGES[3], **bad))


@pytest.mark.parametrize("bad", [
    dict(transport=""), dict(transport_info=None), dict(transport_info={**INFO.to_wire(), "port": 1 << 20}),
    dict(transport_info={**INFO.to_wire(), "token": b"x" * 2000}), dict(unexpected=1),
])
def test_pair_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(CodecError):
        decode_message(_msg_wire(Pair(transport="gloo", transport_info=INFO), **bad))


def test_hello_rejects_short_nonce_and_mac() -> None:
    with pytest.raises(CodecError):
        decode_message(_msg_wire(MESSAGES[1], nonce=b"short"))
    with pytest.raises(CodecError):
        decode_message(_msg_wire(MESSAGES[1], mac=b"x" * 31))
    with pytest.raises(CodecError):
        decode_message(_msg_wire(MESSAGES[1], timestamp=float("inf")))


def test_error_reason_is_truncated_to_stay_decodable() -> None:
    e = Error(code="refused", reason="x" * 100_000)
    assert decode_message(encode_message(e)) == e and len(e.reason) <= 1000


def test_the_codec_needs_msgpack_only_when_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module imports without msgpack (the NCCL hand-off needs none); packing or unpacking asks
    for it by name, never as a `CodecError` about the bytes."""
    monkeypatch.setitem(sys.modules, "msgpack", None)
    with pytest.raises(MissingDependencyError, match="KV control channel's codec needs the 'msgpack' package"):
        encode_handle(handle())
    with pytest.raises(MissingDependencyError, match="'msgpack' package"):
        decode_handle(b"\x80")
