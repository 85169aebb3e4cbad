"""Workload profiles for the load tests and benchmarks: what a user asks, how long, how much back.

Owns: `Workload` (one kind of request: prompt tokens, output tokens), `Profile` (a weighted mix of
workloads), the shipped `PROFILES` (``chat``, ``long``, ``mixed``) and `make_prompt`, which builds a
chat message from a fixed word list so its token count is known without a tokenizer.

Invariants: every word in `WORDS` is one token of SmolLM2's tokenizer when it follows a space, so a
message of ``n`` words is ``n`` tokens and the whole chat prompt is ``n + CHAT_TEMPLATE_TOKENS``
(the template with its default system prompt); `tests/loadtests` checks this with the real
tokenizer. Prompts come from a seeded `random.Random`: the same seed gives the same prompt, and
different seeds differ from the first word on (so the prefix cache never turns one long prompt
into a cheap one).

Pure Python: the locustfile imports this without torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Tokens the SmolLM2 chat template adds around one user message (system prompt included).
CHAT_TEMPLATE_TOKENS = 30

_WORD_TEXT = """the of and to in is was for on that with as by at from his her it an be are this which or had not
    but were have they one all their there been has when who more will would so if out up about into than
    them can only other new some could time these two may first then do any like my now over such our man
    me even most made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still own see men work
    long get here between both life being under never day same another know while last might us great old
    year off come since against go came right used take three"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Workload:
    """One kind of request: a chat prompt of about ``prompt_tokens`` tokens, ``max_tokens`` generated."""

    name: str
    prompt_tokens: int
    max_tokens: int

    def with_max_tokens(self, max_tokens: int | None) -> Workload:
        if max_tokens is None:
            return self
        return Workload(self.name, self.prompt_tokens, max_tokens)


@dataclass(frozen=True)
class Profile:
    """A weighted mix of workloads; `pick` draws one per request."""

    name: str
    workloads: tuple[tuple[Workload, float], ...]

    def pick(self, rng: random.Random) -> Workload:
        kinds = [w for w, _ in self.workloads]
        return rng.choices(kinds, weights=[wt for _, wt in self.workloads])[0]

    def with_max_tokens(self, max_tokens: int | None) -> Profile:
        return Profile(self.name, tuple((w.with_max_tokens(max_tokens), wt) for w, wt in self.workloads))


CHAT = Workload("chat", prompt_tokens=100, max_tokens=128)
LONG = Workload("long", prompt_tokens=2000, max_tokens=64)

#: The goodput benchmark's kinds: a 30-word chat message (60 tokens with the template) and a document.
GOODPUT_CHAT = Workload("chat", prompt_tokens=60, max_tokens=48)
GOODPUT_LONG = Workload("long", prompt_tokens=1400, max_tokens=48)

PROFILES: dict[str, Profile] = {
    "chat": Profile("chat", ((CHAT, 1.0),)),
    "long": Profile("long", ((LONG, 1.0),)),
    "mixed": Profile("mixed", ((CHAT, 0.9), (LONG, 0.1))),
    "goodput": Profile("goodput", ((GOODPUT_CHAT, 0.85), (GOODPUT_LONG, 0.15))),
}


def get_profile(name: str, max_tokens: int | None = None) -> Profile:
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; expected one of {sorted(PROFILES)}") from None
    return profile.with_max_tokens(max_tokens)


def message_words(prompt_tokens: int) -> int:
    """Words in the user message so the templated chat prompt is ``prompt_tokens`` tokens."""
    return max(1, prompt_tokens - CHAT_TEMPLATE_TOKENS)


def make_prompt(prompt_tokens: int, rng: random.Random) -> str:
    """A user message whose chat prompt is ``prompt_tokens`` tokens (see the module invariants)."""
    return " ".join(rng.choice(WORDS) for _ in range(message_words(prompt_tokens)))


def chat_body(model: str, workload: Workload, rng: random.Random) -> dict[str, object]:
    """The ``/v1/chat/completions`` body for one streamed request of ``workload``: greedy, exact length."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": make_prompt(workload.prompt_tokens, rng)}],
        "max_tokens": workload.max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # the output is exactly max_tokens long, whatever the model would say
        "stream": True,
        "stream_options": {"include_usage": True},
    }
