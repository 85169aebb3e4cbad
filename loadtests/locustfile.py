"""Locust users for pdserve: OpenAI streaming chat requests that report TTFT, ITL, TPOT and E2E.

Owns: `StreamingChatUser` (closed loop: each user sends its next request when the stream ends) and
the command-line options ``--profile`` (``chat`` | ``long`` | ``mixed``, env ``PDSERVE_PROFILE``;
locust's own run-label option, read here as the workload profile), ``--model`` (env
``PDSERVE_MODEL``), ``--max-tokens`` (env ``PDSERVE_MAX_TOKENS``, overrides the profile's output
length) and ``--seed``.

Every request posts ``/v1/chat/completions`` with ``stream: true``, ``stream_options.include_usage``,
``temperature: 0`` and ``ignore_eos: true`` (so output lengths are the profile's). Besides locust's
own POST row it fires, as their own request types named after the workload (``chat`` / ``long``):
``TTFT`` (send → first token chunk), ``ITL`` (one per gap between token chunks), ``TPOT``
((E2E − TTFT) / (output tokens − 1)) and ``E2E`` (send → end of stream), all in milliseconds, the
definitions of docs/architecture.md "Metrics". A stream that fails counts as a failure of E2E.

    python -m locust -f loadtests/locustfile.py --headless -u 8 -r 8 --run-time 60s \\
        --host http://127.0.0.1:8000 --profile mixed --csv results/loadtest_mixed --html results/x.html
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from typing import Any

from locust import HttpUser, constant, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment

from loadtests.profiles import PROFILES, Profile, chat_body, get_profile

DEFAULT_MODEL = "smollm2-135m-instruct"
PATH = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _add_options(parser: LocustArgumentParser) -> None:
    # ``--profile`` is locust's own option (a label for the run, shown in the report): we read it as the
    # workload profile, so the report names the profile that ran.
    parser.add_argument("--model", default=DEFAULT_MODEL, env_var="PDSERVE_MODEL", help="served model name")
    parser.add_argument("--max-tokens", type=int, default=0, env_var="PDSERVE_MAX_TOKENS",
                        help="output tokens per request (0: the profile's)")
    parser.add_argument("--seed", type=int, default=0, env_var="PDSERVE_SEED", help="prompt and mix seed")


def profile_name(env: Environment) -> str:
    """``--profile`` (locust's option), else ``PDSERVE_PROFILE``, else ``mixed``."""
    opts = env.parsed_options
    return (getattr(opts, "profile", None) if opts is not None else None) or os.environ.get(
        "PDSERVE_PROFILE", "mixed")


@events.init.add_listener
def _check_profile(environment: Environment, **_: Any) -> None:
    name = profile_name(environment)
    if name not in PROFILES:
        logging.error("unknown --profile %r; expected one of %s", name, ", ".join(sorted(PROFILES)))
        environment.process_exit_code = 2
        if environment.runner is not None:
            environment.runner.quit()


class StreamingChatUser(HttpUser):
    """One user of a streaming chat client (see the module docstring)."""

    wait_time = constant(0)
    _next_id = 0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.profile: Profile = get_profile(profile_name(self.environment), getattr(opts, "max_tokens", 0) or None)
        self.model: str = getattr(opts, "model", DEFAULT_MODEL)
        StreamingChatUser._next_id += 1
        self.rng = random.Random(f"{getattr(opts, 'seed', 0)}-{StreamingChatUser._next_id}")

    @task
    def chat(self) -> None:
        workload = self.profile.pick(self.rng)
        body = chat_body(self.model, workload, self.rng)
        t0 = time.perf_counter()
        arrivals: list[float] = []
        usage_tokens: int | None = None
        error: str | None = None
        with self.client.post(PATH, json=body, stream=True, catch_response=True, name=PATH,
                              timeout=600) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                resp.failure(error)
            else:
                try:
                    usage_tokens, error = _read_stream(resp.iter_lines(), arrivals)
                except Exception as e:  # a broken connection mid-stream
                    error = f"stream broke: {e!r}"
                if error:
                    resp.failure(error)
                else:
                    resp.success()
        end = time.perf_counter()
        report(self.environment, workload.name, t0, arrivals, end, usage_tokens, error)


def _read_stream(lines: Any, arrivals: list[float]) -> tuple[int | None, str | None]:
    """Consume SSE lines, appending the arrival time of every token chunk; → (usage tokens, error)."""
    usage: int | None = None
    for raw in lines:
        if not raw:
            continue
        line = raw.decode() if isinstance(raw, bytes) else str(raw)
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return usage, None
        chunk = json.loads(data)
        if "error" in chunk:
            return usage, f"stream error: {chunk['error']}"
        if chunk.get("choices"):
            arrivals.append(time.perf_counter())
        if chunk.get("usage"):
            usage = int(chunk["usage"]["completion_tokens"])
    return usage, "the stream ended without [DONE]"


def report(env: Environment, name: str, t0: float, arrivals: list[float], end: float,
           usage_tokens: int | None, error: str | None) -> None:
    """Fire TTFT / ITL / TPOT / E2E for one request (times in ms, as locust expects)."""
    fire = env.events.request.fire
    e2e_ms = (end - t0) * 1000
    if error is not None:
        fire(request_type="E2E", name=name, response_time=e2e_ms, response_length=len(arrivals),
             exception=RuntimeError(error), context={})
        return
    if arrivals:
        ttft_ms = (arrivals[0] - t0) * 1000
        fire(request_type="TTFT", name=name, response_time=ttft_ms, response_length=0, exception=None, context={})
        for a, b in itertools.pairwise(arrivals):
            fire(request_type="ITL", name=name, response_time=(b - a) * 1000, response_length=0,
                 exception=None, context={})
        n_out = usage_tokens if usage_tokens is not None else len(arrivals)
        if n_out > 1:
            tpot_ms = (e2e_ms - ttft_ms) / (n_out - 1)
            fire(request_type="TPOT", name=name, response_time=tpot_ms, response_length=0, exception=None,
                 context={})
    fire(request_type="E2E", name=name, response_time=e2e_ms, response_length=usage_tokens or len(arrivals),
         exception=None, context={})
