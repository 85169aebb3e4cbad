"""Fake prefill/decode replicas and a fake tokenizer, implementing the replica interface exactly.

The "model" is deterministic: after token t comes ``successor(t)`` (printable ASCII, wrapping), so
a test knows every completion in advance. The tokenizer is one token per character (ids are code
points below 256; id 0 is EOS). Prompts steer the fakes with magic words:

- ``QUEUEFULL``: the first pool raises `QueueFullError(retry_after_s=3)`;
- ``CRASH1``: the prefill replica's process exits the first time (a marker file remembers);
- ``MIDERR``: the decode stream sends two events, then an error event;
- ``EOSAT<k>``: the k-th generated token is EOS (finish "stop");
- ``SLOW``: 30 ms per decode event (for disconnect tests); otherwise 1 ms;
- ``SAY[[text]]``: the answer is ``text``, one character per token, then EOS (a scripted answer,
  e.g. a tool call, through either pool).

`FakeToolCodec` is the fake tokenizer with a chat template that renders tools (Hermes-style
``<tool_call>`` markers), for the tool-calling tests.

Choices (``n > 1``): choice ``i`` is the same model started ``i`` tokens further on (its token 0 is
the prompt's successor's ``i``-th successor), so the choices' texts differ and each is known in
advance (`expected_choice_text`); the decode fake interleaves the choices' events, one token each
per step.

Decode replicas record every request whose stream was cancelled (`cancelled()`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
from ray.exceptions import ActorDiedError

from decode_worker.types import DecodeChoice, DecodeRequest, DecodeTimings, TokenEvent
from engine.errors import QueueFullError
from engine.load_report import LoadReport
from engine.sampling.grammar import GrammarError, GrammarSpec
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingDefaults
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from prefill_worker.types import FirstToken, PrefillRequest, PrefillResult, PrefillTimings
from router.config import RouterConfig

EOS = 0
LOGPROB = -0.25
FIRST_LATE_S = 0.4  # how late the fake decode's first event is for a prompt saying FIRSTLATE


def successor(t: int) -> int:
    return 32 + ((t - 32 + 1) % 95) if 32 <= t < 127 else 97


def expected_tokens(prompt_ids: Sequence[int], n: int) -> list[int]:
    out, t = [], prompt_ids[-1]
    for _ in range(n):
        t = successor(t)
        out.append(t)
    return out


def fake_top(t: int, k: int) -> tuple[tuple[int, float], ...]:
    """The fakes' top_logprobs for token ``t``: ``t`` itself, then its successors, each 1 lower."""
    out = []
    for i in range(k):
        out.append((t, LOGPROB - i))
        t = successor(t)
    return tuple(out)


def fake_prompt_logprobs(prompt_ids: Sequence[int], k: int | None) -> PromptLogprobs | None:
    """The fakes' prompt log-probs (None unless asked): each prompt token ``LOGPROB`` at rank 1, its
    alternatives `fake_top`'s."""
    if k is None:
        return None
    tops = [fake_top(t, k) for t in prompt_ids[1:]]
    return PromptLogprobs((LOGPROB,) * len(tops), (1,) * len(tops), tuple(tuple(t for t, _ in top) for top in tops),
                          tuple(tuple(v for _, v in top) for top in tops))


def expected_text(prompt: str, n: int) -> str:
    return "".join(chr(t) for t in expected_tokens([ord(c) for c in prompt], n))


def shifted(t: int, k: int) -> int:
    for _ in range(k):
        t = successor(t)
    return t


def expected_choice_text(prompt: str, n: int, index: int) -> str:
    """Choice ``index``'s completion of ``n`` tokens."""
    return "".join(chr(shifted(t, index)) for t in expected_tokens([ord(c) for c in prompt], n))


class FakeDetokenizer:
    def push(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


class FakeCodec:
    eos_token_ids = (EOS,)
    sampling_defaults = SamplingDefaults()
    vocab_size = 256
    max_model_len = None
    chat_template = None  # its chat format renders no tools
    renders_tools = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) if ord(c) < 256 else ord("?") for c in text]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        if any(m["role"] == "assistant" and m["content"] == "RAISE" for m in messages):
            raise ValueError("Conversation roles must alternate")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + "<assistant>" if add_generation_prompt else text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def is_special_token(self, text: str) -> bool:
        return False

    def detokenizer(self, skip_special_tokens: bool = True) -> FakeDetokenizer:
        return FakeDetokenizer()

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """llguidance's own check without a vocabulary (this tokenizer has no tokenizer.json)."""
        error = llguidance.LLMatcher.validate_grammar(spec.llguidance_grammar())
        if error:
            raise GrammarError(error)


def fake_codec(_: RouterConfig) -> FakeCodec:
    return FakeCodec()


class FakeToolCodec(FakeCodec):
    """Renders the tools as ``<tools>[...]</tools>`` before the messages; teaches ``<tool_call>``."""

    chat_template = "{{ tools }}{{ messages }} <tool_call></tool_call> tool_calls"
    renders_tools = True

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        head = self.encode(f"<tools>{json.dumps(list(tools))}</tools>") if tools else []
        return head + super().encode_chat(messages, add_generation_prompt)


def fake_tool_codec(_: RouterConfig) -> FakeToolCodec:
    return FakeToolCodec()


SCRIPT = re.compile(r"SAY\[\[(.*?)\]\]", re.S)


def script(prompt: str) -> str | None:
    """The scripted answer a prompt asks for (``SAY[[text]]``), if any."""
    m = SCRIPT.search(prompt)
    return m.group(1) if m and m.group(1) else None


def chat_prompt_ids(messages: Sequence[dict[str, str]]) -> list[int]:
    return FakeCodec().encode_chat(messages)


def prompt_text(ids: Sequence[int]) -> str:
    """The prompt as the fakes read it: one character per id below 256."""
    return "".join(chr(i) for i in ids if i < 256)


LAYOUT = KVLayout(arch="llama", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=16)


@dataclass(frozen=True)
class FakeConfig:
    marker_dir: str = "/tmp"
    role: str = "prefill"


class FakePrefill:
    def __init__(self, config: object) -> None:
        self._marker = Path(getattr(config, "marker_dir", "/tmp")) / "pdserve-fake-crash1"
        self._running = 0

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        text = prompt_text(req.prompt_token_ids)
        if "QUEUEFULL" in text:
            raise QueueFullError("prefill queue full", retry_after_s=3.0)
        if "CRASH1" in text and not self._marker.exists():
            self._marker.write_text("crashed")
            os._exit(1)
        self._running += 1
        try:
            await asyncio.sleep(0.002)
        finally:
            self._running -= 1
        said = script(text)
        token = ord(said[0]) if said else successor(req.prompt_token_ids[-1])
        finished = req.sampling.max_tokens == 1
        handle = None if finished else KVHandle(
            transfer_id=req.request_id, source_host="127.0.0.1", source_port=9,
            n_tokens=len(req.prompt_token_ids), layout=LAYOUT, expires_at=time.time() + 30)
        reason = "length" if finished else None
        firsts = [token if said else shifted(token, i) for i in range(req.n)]  # every choice says a script
        choices = tuple(FirstToken(t, LOGPROB, fake_top(t, req.sampling.top_logprobs), reason) for t in firsts)
        return PrefillResult(request_id=req.request_id, choices=choices, handle=handle, finished=finished,
                             timings=PrefillTimings(queue_s=0.001, prefill_s=0.002),
                             prompt_logprobs=fake_prompt_logprobs(req.prompt_token_ids, req.prompt_logprobs))

    async def load(self) -> LoadReport:
        return LoadReport(replica_id=f"fake-prefill-{os.getpid()}", role="prefill", num_waiting=0,
                          num_running=self._running, outstanding_tokens=0, kv_blocks_free=100,
                          kv_blocks_total=128)

    async def ready(self) -> bool:
        return True


class FakeDecode:
    def __init__(self, config: object) -> None:
        self._cancelled: list[str] = []
        self._running = 0

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        text = prompt_text(req.prompt_token_ids)
        choices = req.choices
        colocated = choices[0].first_token_id is None
        if colocated and "QUEUEFULL" in text:
            raise QueueFullError("decode queue full", retry_after_s=3.0)
        m = re.search(r"EOSAT(\d+)", text)
        eos_at = int(m.group(1)) if m else None
        delay = 0.03 if "SLOW" in text else 0.001
        said = script(text)
        n_max = req.sampling.max_tokens
        live = {c.index: self._start(req, c) for c in choices}  # index → [last token, tokens produced]
        if "FIRSTLATE" in text:  # a long first wait: a long prompt's prefill here, or a stall after token 0
            await asyncio.sleep(FIRST_LATE_S)
        self._running += 1
        try:
            while live:
                await asyncio.sleep(delay)
                for index, state in list(live.items()):
                    t, produced = state
                    if "MIDERR" in text and produced >= 3:
                        yield TokenEvent(request_id=req.request_id, token_ids=(), index=index, finish_reason="error",
                                         error="fake decode failure")
                        return
                    produced += 1
                    if said is not None:  # every choice says the script
                        t = ord(said[produced - 1]) if produced <= len(said) else EOS
                    else:
                        t = EOS if eos_at is not None and produced == eos_at else successor(t)
                    live[index] = [t, produced]
                    finish = "stop" if t == EOS else ("length" if produced == n_max else None)
                    timings = DecodeTimings(queue_s=0.001, transfer_s=0.001, prefill_s=0.002) if finish else None
                    first = produced == 1 and index == choices[0].index  # colocated token 0 of the first choice
                    scores = fake_prompt_logprobs(req.prompt_token_ids, req.prompt_logprobs) if first else None
                    yield TokenEvent(request_id=req.request_id, token_ids=(t,), index=index, logprobs=(LOGPROB,),
                                     top_logprobs=(fake_top(t, req.sampling.top_logprobs),),
                                     finish_reason=finish, timings=timings, prompt_logprobs=scores)
                    if finish:
                        del live[index]
        except asyncio.CancelledError:
            self._cancelled.append(req.request_id)
            raise
        finally:
            self._running -= 1

    @staticmethod
    def _start(req: DecodeRequest, c: DecodeChoice) -> list[int]:
        """A choice's last token and the tokens it has: the tokens sent (token 0 from the prefill, a
        continuation's every one), or (colocated) the prompt's last token moved on by the choice's
        shift, and none yet."""
        if not c.generated:
            return [shifted(req.prompt_token_ids[-1], c.index), 0]
        return [c.generated[-1], len(c.generated)]

    async def cancelled(self) -> list[str]:
        return list(self._cancelled)

    async def load(self) -> LoadReport:
        return LoadReport(replica_id=f"fake-decode-{os.getpid()}", role="decode", num_waiting=0,
                          num_running=self._running, outstanding_tokens=0, kv_blocks_free=90,
                          kv_blocks_total=128)

    async def ready(self) -> bool:
        return True


class FailingDecode(FakeDecode):
    """The first ``failures`` decode calls break after ``after`` events: their replica dies
    (ActorDiedError) or, with ``hang``, goes silent (cancelled streams are recorded in ``hung``)."""

    def __init__(self, failures: int, after: int = 3, hang: bool = False) -> None:
        super().__init__(None)
        self.failures, self.after, self.hang = failures, after, hang
        self.requests: list[DecodeRequest] = []
        self.hung: list[str] = []

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        failing = self.failures > 0
        self.failures -= failing
        n = 0
        async for ev in super().generate(req):
            if failing and n == self.after:
                if not self.hang:
                    raise ActorDiedError()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    self.hung.append(req.request_id)
                    raise
            yield ev
            n += 1
