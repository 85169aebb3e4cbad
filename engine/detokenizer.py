"""Incremental detokenization for streaming: token ids in, newly completed text out.

Owns: `IncrementalDetokenizer`, one per generated sequence.

How: the ids are split by two offsets, as in vLLM's ``detokenize_incrementally``::

    ids:  [ ... emitted ... | prefix ... read | pending ... ]
                            ^ prefix_offset   ^ read_offset

``ids[prefix:read]`` is the last emitted chunk, kept only as context (so decoders that treat the first
token specially, and byte-level merges across token borders, see what they saw in the full decode).
Each push decodes ``ids[prefix:]`` and emits what goes past ``decode(ids[prefix:read])``, unless the
result ends in U+FFFD: then the tail may be half a multi-byte UTF-8 character and it is held back.
On an emit both offsets move forward, so the window is the last chunk plus what is pending: O(1) per
token for ordinary text, however long the sequence.

Invariants:
- ``"".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens)``.
- A chunk returned by `push` never ends in U+FFFD; a U+FFFD inside one is in the full decode too, at
  the same place (it was a genuinely invalid byte sequence, not a character cut in half).
- Offsets only move at a point where the decoded text so far ends on a whole character.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text chunks, never splitting a character."""

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # everything before this has been emitted
        self._prefix_text = ""  # decode(ids[prefix:read]), cached between pushes
        self._finished = False

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(self._prefix_text):
            return ""  # only skipped special tokens (or nothing) since the last emit
        if not final and new_text.endswith(_REPLACEMENT):
            return ""  # possibly half a character: wait for the next token
        chunk = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return chunk

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often the empty string)."""
        if self._finished:
            raise RuntimeError("push() after flush(): this detokenizer's sequence is finished")
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (a trailing U+FFFD included); later pushes are refused."""
        if self._finished:
            return ""
        self._finished = True
        return self._advance(final=True)
