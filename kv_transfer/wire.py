"""Checked msgpack: bounded decoding and typed field readers for everything that crosses a process.

Owns: `pack` (deterministic msgpack of a map), `unpack_map` (size-limited, length-limited decode of
untrusted bytes into a map), and `Fields`, a reader that pulls typed, range-checked values out of
that map and refuses unknown keys.

Invariants: decoding untrusted bytes raises `CodecError` and nothing else, whatever the bytes; a
value is never coerced (``True`` is not an int, ``1`` is not a string, NaN is not a float);
identifiers are non-empty, bounded, and drawn from a small safe alphabet.

msgpack is imported where a map is first packed or unpacked: the transports and the block
helpers import this module's patterns, and a process that never speaks the control channel (the
in-process NCCL hand-off of ``make gpu-check``) runs without the package.
"""

from __future__ import annotations

import math
import re
from typing import Any

from engine.errors import missing_dependency
from kv_transfer.errors import CodecError

_NEEDED_FOR = "the KV control channel's codec"

#: Identifiers (transfer ids, node ids): what goes into logs and store keys, so keep them boring.
ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: A host name or an IPv4/IPv6 literal (with an optional zone id).
HOST_RE = re.compile(r"[A-Za-z0-9.\-:_%\[\]]{1,255}")
#: A short machine name: transport names, architecture names, error codes.
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

#: Bounds on a single decoded container or string; each frame kind also has its own total limit.
_MAX_STR = 4096
_MAX_BIN = 4096
_MAX_ARRAY = 65536
_MAX_MAP = 64


def pack(obj: dict[str, Any]) -> bytes:
    """msgpack of a map, binary-safe (``bytes`` stays ``bytes``)."""
    with missing_dependency("msgpack", _NEEDED_FOR):
        import msgpack
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def unpack_map(data: object, *, max_bytes: int, what: str) -> Fields:
    """Decode ``data`` (at most ``max_bytes``) into a `Fields` reader over a msgpack map."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise CodecError(f"{what}: {len(data)} bytes is over the {max_bytes}-byte limit")
    if len(data) == 0:
        raise CodecError(f"{what}: empty input")
    with missing_dependency("msgpack", _NEEDED_FOR):
        import msgpack
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_BIN,
            max_array_len=_MAX_ARRAY,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    except Exception as e:  # untrusted bytes: every way msgpack can fail is a codec error
        raise CodecError(f"{what}: not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CodecError(f"{what}: expected a map, got {type(obj).__name__}")
    return Fields(obj, what)


class Fields:
    """Typed reader over one decoded msgpack map; call `finish` once every field has been read."""

    def __init__(self, data: dict[Any, Any], what: str) -> None:
        self._data = data
        self._seen: set[str] = set()
        self.what = what

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        if key not in self._data:
            raise CodecError(f"{self.what}: missing field {key!r}")
        return self._data[key]

    def has(self, key: str) -> bool:
        return key in self._data

    def _bad(self, key: str, msg: str) -> CodecError:
        return CodecError(f"{self.what}: field {key!r} {msg}")

    def get_int(self, key: str, *, lo: int, hi: int) -> int:
        v = self._get(key)
        if type(v) is not int:
            raise self._bad(key, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise self._bad(key, f"must be in [{lo}, {hi}], got {v}")
        return v

    def get_float(self, key: str, *, lo: float, hi: float) -> float:
        v = self._get(key)
        if type(v) not in (int, float):
            raise self._bad(key, f"must be a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f) or not lo <= f <= hi:
            raise self._bad(key, f"must be a finite number in [{lo}, {hi}], got {v!r}")
        return f

    def get_str(self, key: str, *, pattern: re.Pattern[str] | None = None, max_len: int = 256,
            allow_empty: bool = False) -> str:
        v = self._get(key)
        if type(v) is not str:
            raise self._bad(key, f"must be a string, got {type(v).__name__}")
        if not v and allow_empty:
            return v
        if not v or len(v) > max_len:
            raise self._bad(key, f"must be 1..{max_len} characters, got {len(v)}")
        if pattern is not None and not pattern.fullmatch(v):
            raise self._bad(key, f"has characters outside {pattern.pattern}: {v[:64]!r}")
        return v

    def get_bytes(self, key: str, *, min_len: int = 0, max_len: int = 1024) -> bytes:
        v = self._get(key)
        if type(v) is not bytes:
            raise self._bad(key, f"must be binary, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise self._bad(key, f"must be {min_len}..{max_len} bytes, got {len(v)}")
        return v

    def get_ints(self, key: str, *, lo: int, hi: int, max_len: int) -> tuple[int, ...]:
        v = self._get(key)
        if type(v) is not list:
            raise self._bad(key, f"must be a list, got {type(v).__name__}")
        if len(v) > max_len:
            raise self._bad(key, f"has {len(v)} items, over the limit of {max_len}")
        for x in v:
            if type(x) is not int or not lo <= x <= hi:
                raise self._bad(key, f"items must be integers in [{lo}, {hi}], got {x!r}")
        return tuple(v)

    def get_map(self, key: str) -> Fields:
        v = self._get(key)
        if type(v) is not dict:
            raise self._bad(key, f"must be a map, got {type(v).__name__}")
        return Fields(v, f"{self.what}.{key}")

    def is_nil(self, key: str) -> bool:
        """True (and the field counts as read) when ``key`` is present and nil."""
        if key in self._data and self._data[key] is None:
            self._seen.add(key)
            return True
        return False

    def finish(self) -> None:
        """Refuse fields this version does not know: a newer peer must bump the version instead."""
        extra = [k for k in self._data if k not in self._seen]
        if extra:
            shown = ", ".join(repr(k)[:40] for k in extra[:5])
            raise CodecError(f"{self.what}: unknown field(s) {shown}")
