"""deploy/nginx.conf in front of the multi-node cluster: SSE tokens arrive one by one through it
(spread over the stream's life, not in one burst at the end), plain requests work, and the body
limit matches the router's."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.bench_common import free_port
from tests.support.markers import NGINX, require
from tests.support.multinode import Deployed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx.conf"
PROMPT = list(range(100, 140))


def nginx_binary() -> str:
    return require(NGINX)


def _sub(pattern: str, repl: str, text: str, count: int | None = 1) -> str:
    new, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    assert n >= 1 and (count is None or n == count), f"deploy/nginx.conf changed shape: {pattern!r} matched {n}x"
    return new


def render(prefix: Path, listen: int, upstream: int) -> Path:
    """The shipped file with only its addresses and paths pointed at this test."""
    text = CONF.read_text()
    text = _sub(r"^(\s*)server \S+:\d+ (max_fails=\S+ fail_timeout=\S+;)\n", "", text, count=None)
    text = _sub(r"^(\s*upstream pdserve \{\n)", rf"\g<1>        server 127.0.0.1:{upstream} max_fails=3 "
                r"fail_timeout=10s;\n", text)
    text = _sub(r"^(\s*)listen 8080;", rf"\g<1>listen 127.0.0.1:{listen};", text)
    text = _sub(r"^(\s*)access_log \S+;", rf"\g<1>access_log {prefix}/access.log;", text)
    temp = "".join(f"    {d}_temp_path {prefix}/{d};\n" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = _sub(r"^(http \{\n)", rf"\g<1>{temp}", text)
    out = prefix / "nginx.conf"
    out.write_text(text)
    return out


@pytest.fixture(scope="module")
def lb(deployed: Deployed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = nginx_binary()
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = render(prefix, port, deployed.http_port)
    glob = f"daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log info;"
    args = [binary, "-p", str(prefix), "-c", str(conf), "-g", glob]
    check = subprocess.run([*args, "-t"], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGQUIT)  # graceful: workers finish, then the master exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


def stream_arrivals(url: str, max_tokens: int) -> tuple[float, list[tuple[float, dict]], dict[str, str]]:
    """POST a streamed completion; every SSE event with the time its bytes arrived."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    events: list[tuple[float, dict]] = []
    buf = b""
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        headers = dict(r.headers)
        for raw in r.iter_raw():
            now = time.perf_counter()
            buf += raw
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                data = frame.decode().removeprefix("data: ")
                if data != "[DONE]":
                    events.append((now, json.loads(data)))
    return t0, events, headers


def test_streamed_tokens_arrive_one_by_one_through_nginx(lb: str, deployed: Deployed) -> None:
    n = 400
    t0, events, headers = stream_arrivals(lb, n)
    assert headers["content-type"].startswith("text/event-stream")
    assert all("error" not in e for _, e in events), events[-1]
    tokens = [t for _, e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == n and len(events) == n  # one SSE event per token, none merged
    times = [t - t0 for t, _ in events]
    first, last = times[0], times[-1]
    distinct = len({round(t, 3) for t in times})
    # Buffered by the proxy, every event would arrive together at the end: first ≈ last, few reads.
    assert first < 0.5 * last, f"first event at {first:.3f}s, last at {last:.3f}s"
    # The same stream straight from Serve's proxy: same chunks, and through nginx the first one
    # comes before the direct stream is even over. How many reads a stream takes depends on how busy
    # the machine is, so nginx's count is judged against the direct stream's, not a fixed number.
    d0, direct, _ = stream_arrivals(deployed.base_url, n)
    assert [e["choices"][0]["text"] for _, e in events] == [e["choices"][0]["text"] for _, e in direct]
    assert first < direct[-1][0] - d0, (first, direct[-1][0] - d0)
    direct_distinct = len({round(t, 3) for t, _ in direct})
    assert distinct >= direct_distinct // 2, f"{distinct} reads through nginx, {direct_distinct} direct"


def test_plain_requests_and_limits_through_nginx(lb: str, deployed: Deployed) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    via = httpx.post(f"{lb}/v1/completions", json=body, timeout=60)
    direct = httpx.post(f"{deployed.base_url}/v1/completions", json=body, timeout=60)
    assert via.status_code == direct.status_code == 200, via.text
    assert via.json()["choices"] == direct.json()["choices"] and via.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(f"{lb}/ready", timeout=30).json() == {"status": "ready"}
    assert httpx.get(f"{lb}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    # client_max_body_size = limits.max_body_bytes: past it nginx refuses, at it the router answers
    big = {"model": "tiny", "prompt": "x", "pad": "y" * (1 << 20)}
    assert httpx.post(f"{lb}/v1/completions", json=big, timeout=30).status_code == 413
    fits = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "pad": "y" * ((1 << 20) - 1000)})
    assert (1 << 20) - 1000 < len(fits) <= 1 << 20
    r = httpx.post(f"{lb}/v1/completions", content=fits, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
