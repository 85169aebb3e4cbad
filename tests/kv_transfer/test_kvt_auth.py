"""HELLO scheme: right secret passes both ways; wrong secret, replay, reflection and stale clocks fail."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer.auth import check_secret, make_challenge, make_hello, make_welcome, verify_hello, verify_welcome
from kv_transfer.errors import AuthError
from kv_transfer.messages import Welcome

SECRET = b"k" * 32


def test_mutual_success() -> None:
    ch = make_challenge("prefill-a")
    hello = make_hello(SECRET, "decode-b", ch)
    verify_hello(SECRET, hello, ch)
    verify_welcome(SECRET, make_welcome(SECRET, "prefill-a", hello, ch), hello, ch)


def test_wrong_secret_fails_both_ways() -> None:
    ch = make_challenge("prefill-a")
    hello = make_hello(b"w" * 32, "decode-b", ch)
    with pytest.raises(AuthError, match="cluster secret"):
        verify_hello(SECRET, hello, ch)
    good = make_hello(SECRET, "decode-b", ch)
    with pytest.raises(AuthError):
        verify_welcome(SECRET, make_welcome(b"w" * 32, "prefill-a", good, ch), good, ch)


def test_replayed_hello_fails_on_a_new_connection() -> None:
    ch1 = make_challenge("prefill-a")
    hello = make_hello(SECRET, "decode-b", ch1)
    with pytest.raises(AuthError):
        verify_hello(SECRET, hello, make_challenge("prefill-a"))  # fresh server nonce


def test_tampered_fields_fail() -> None:
    ch = make_challenge("prefill-a")
    hello = make_hello(SECRET, "decode-b", ch)
    for change in (dict(node_id="decode-evil"), dict(timestamp=hello.timestamp + 1), dict(nonce=b"z" * 32)):
        with pytest.raises(AuthError):
            verify_hello(SECRET, dataclasses.replace(hello, **change), ch)  # type: ignore[arg-type]


def test_hello_mac_cannot_be_reflected_as_welcome() -> None:
    ch = make_challenge("prefill-a")
    hello = make_hello(SECRET, "decode-b", ch)
    with pytest.raises(AuthError):
        verify_welcome(SECRET, Welcome(node_id="prefill-a", mac=hello.mac), hello, ch)


def test_stale_clock_fails() -> None:
    ch = make_challenge("prefill-a")
    hello = make_hello(SECRET, "decode-b", ch, now=1_000.0)
    with pytest.raises(AuthError, match="clock"):
        verify_hello(SECRET, hello, ch, now=2_000.0, max_skew_s=300)


def test_secret_length() -> None:
    with pytest.raises(ValueError):
        check_secret(b"short")
