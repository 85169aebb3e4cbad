"""The HELLO handshake: mutual challenge-response with HMAC-SHA256 over a shared cluster secret.

Scheme (one round trip after connect, the server speaks first):

1. server → ``Challenge(version, server_id, Ns)``, ``Ns`` 32 fresh random bytes per connection.
2. client → ``Hello(version, client_id, Nc, ts, mac)`` with
   ``mac = HMAC(secret, pack(["pdserve-kv/hello", version, client_id, Nc, ts, Ns, server_id]))``.
3. server checks the version, ``|now - ts| <= max_skew_s`` and the MAC (constant-time compare),
   then answers ``Welcome(server_id, HMAC(secret, pack(["pdserve-kv/welcome", server_id, Ns, Nc,
   client_id])))``, which the client checks; else ``Error{auth}`` and the connection closes.

Why it is sound: the server's MAC input contains its own fresh ``Ns``, so a recorded HELLO is
worthless on any other connection (replay needs no nonce cache and no synchronized clocks; the
timestamp check only catches grossly wrong clocks early); the client's ``Nc`` does the same for
WELCOME, so a client cannot be fooled by a server that lacks the secret; the two labels keep a
HELLO MAC from ever passing as a WELCOME MAC (reflection). The ``version`` inside the MAC stops a
downgrade. Not covered: confidentiality and integrity of later frames (no TLS): the channel carries
no secrets, and data-plane tokens are single-pair, but an on-path attacker could tamper after the
handshake. Run the cluster network as trusted, or add TLS.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from kv_transfer.errors import AuthError
from kv_transfer.messages import NONCE_BYTES, PROTOCOL_VERSION, Challenge, Hello, Welcome
from kv_transfer.wire import pack

MIN_SECRET_BYTES = 16
DEFAULT_MAX_SKEW_S = 300.0


def check_secret(secret: bytes) -> bytes:
    """The cluster secret must be real bytes, long enough to resist guessing."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def _mac(secret: bytes, fields: list[object]) -> bytes:
    return hmac.new(secret, pack({"m": fields}), hashlib.sha256).digest()


def make_challenge(server_id: str) -> Challenge:
    return Challenge(version=PROTOCOL_VERSION, node_id=server_id, nonce=secrets.token_bytes(NONCE_BYTES))


def make_hello(secret: bytes, client_id: str, challenge: Challenge, now: float | None = None) -> Hello:
    nonce = secrets.token_bytes(NONCE_BYTES)
    ts = time.time() if now is None else now
    mac = _mac(secret, ["pdserve-kv/hello", PROTOCOL_VERSION, client_id, nonce, ts,
                        challenge.nonce, challenge.node_id])
    return Hello(version=PROTOCOL_VERSION, node_id=client_id, nonce=nonce, timestamp=ts, mac=mac)


def verify_hello(secret: bytes, hello: Hello, challenge: Challenge, *, now: float | None = None,
                 max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
    """Raise `AuthError` with a reason unless ``hello`` answers ``challenge`` under ``secret``."""
    if hello.version != PROTOCOL_VERSION:
        raise AuthError(f"client speaks protocol version {hello.version}, server {PROTOCOL_VERSION}")
    expected = _mac(secret, ["pdserve-kv/hello", hello.version, hello.node_id, hello.nonce, hello.timestamp,
                             challenge.nonce, challenge.node_id])
    if not hmac.compare_digest(expected, hello.mac):
        raise AuthError("HELLO MAC does not verify: the peers do not share the cluster secret")
    skew = (time.time() if now is None else now) - hello.timestamp
    if abs(skew) > max_skew_s:
        raise AuthError(f"client clock is {skew:+.0f}s off the server's (limit {max_skew_s:.0f}s)")


def make_welcome(secret: bytes, server_id: str, hello: Hello, challenge: Challenge) -> Welcome:
    return Welcome(node_id=server_id, mac=_mac(secret, ["pdserve-kv/welcome", server_id, challenge.nonce,
                                                        hello.nonce, hello.node_id]))


def verify_welcome(secret: bytes, welcome: Welcome, hello: Hello, challenge: Challenge) -> None:
    if welcome.node_id != challenge.node_id:
        raise AuthError(f"server changed its id from {challenge.node_id!r} to {welcome.node_id!r}")
    expected = _mac(secret, ["pdserve-kv/welcome", welcome.node_id, challenge.nonce, hello.nonce,
                             hello.node_id])
    if not hmac.compare_digest(expected, welcome.mac):
        raise AuthError("WELCOME MAC does not verify: the server does not hold the cluster secret")
