"""The GPU check's KV hand-off section: a prefill engine's KV cache moves over NCCL (real cupy) into a
decode engine's blocks, and decoding there continues exactly as it would have in place.

Owns: `check_nccl_handoff` (prefill → transfer → decode, compared with the colocated greedy run and
byte for byte with the source blocks) and `nccl_transfer`, the only function that touches the
transport: with two GPUs, a `kv_transfer.nccl.NcclTransport` pair (rank 0 on GPU 0, rank 1 on GPU 1,
opened and run in two threads, as two replicas would); with one GPU, NCCL refuses two ranks on it,
so a single-rank communicator sends to itself, built from the transport's own offer (real cupy's
unique id through the transport's conversion) and fed the same direct-mode tensors.

Invariants: the wire order is the transport's direct mode (`kv_transfer.blocks`: per layer, K then
V, one tensor per run of consecutive destination ids); the destination's ids are interleaved with
ids it does not use, so every run is cut; imports stay inside kv_transfer's transport modules (its
package ``__init__`` brings msgpack, never Ray): a missing module is a skip that names it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from loadtests.gpu_check_families import engine_greedy
from loadtests.gpu_check_models import engine_config
from loadtests.gpu_check_report import Check

TIMEOUT_S = 60.0
N_NEW = 16


def nccl_transfer(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> str:
    """Send ``src`` into ``dst`` (pairwise equal shapes) over NCCL; returns how (for the report)."""
    from kv_transfer.nccl import NcclTransport
    from kv_transfer.transport import DEST_RANK, SOURCE_RANK, TransportInfo

    src_dev, dst_dev = src[0].device, dst[0].device
    if src_dev != dst_dev:
        ends = []
        for rank, dev in ((SOURCE_RANK, src_dev), (DEST_RANK, dst_dev)):
            with torch.cuda.device(dev):
                ends.append(NcclTransport(rank, host="127.0.0.1", timeout_s=TIMEOUT_S))
        source, dest = ends
        offer = source.offer(dest.local_info())
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(t.open, offer, TIMEOUT_S) for t in ends]:
                f.result()
            sent = pool.submit(source.send, src, TIMEOUT_S)
            dest.recv(dst, TIMEOUT_S)
            sent.result()
        for t in ends:
            t.close()
        return f"NcclTransport pair, {src_dev} -> {dst_dev}"
    with torch.cuda.device(src_dev) if src_dev.type == "cuda" else nullcontext():
        t = NcclTransport(SOURCE_RANK, host="127.0.0.1", timeout_s=TIMEOUT_S)
    offer = t.offer(TransportInfo(name="nccl", device=t.device + "/loopback"))
    cupy, nccl = t._cupy, t._nccl
    with cupy.cuda.Device(t.device_index):
        try:
            comm = nccl.NcclCommunicator(1, offer.token, 0)
        except TypeError:  # cupy < 13 wants a tuple of signed chars (as NcclTransport.open)
            comm = nccl.NcclCommunicator(1, tuple(b - 256 if b > 127 else b for b in offer.token), 0)
        stream = cupy.cuda.Stream(non_blocking=True)
        nccl.groupStart()
        for s, d in zip(src, dst, strict=True):
            comm.send(s.data_ptr(), s.numel() * s.element_size(), nccl.NCCL_UINT8, 0, stream.ptr)
            comm.recv(d.data_ptr(), d.numel() * d.element_size(), nccl.NCCL_UINT8, 0, stream.ptr)
        nccl.groupEnd()
        done = cupy.cuda.Event(disable_timing=True)  # polled as NcclTransport polls: errors surface
        done.record(stream)
        deadline = time.monotonic() + TIMEOUT_S
        while not done.done:
            comm.check_async_error()
            if time.monotonic() > deadline:
                comm.abort()
                raise TimeoutError(f"nccl: self send/recv of {len(src)} tensors timed out after {TIMEOUT_S:.0f}s")
            time.sleep(0.0002)
        comm.destroy()
    t.close()
    return f"single-rank communicator sending to itself on {src_dev}"


def _in_thread(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], wait_s: float) -> str | None:
    """`nccl_transfer` in a daemon thread; None where it has not returned after ``wait_s`` (a
    communicator that never connects must not stop the rest of the run)."""
    done: list[str] = []
    raised: list[BaseException] = []

    def go() -> None:
        try:
            done.append(nccl_transfer(src, dst))
        except BaseException as e:
            raised.append(e)

    worker = threading.Thread(target=go, name="gpu-check-nccl", daemon=True)
    worker.start()
    worker.join(wait_s)
    if raised:
        raise raised[0]
    return done[0] if done else None


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "NCCL needs a CUDA device"
    try:
        from kv_transfer.nccl import NcclTransport
    except ImportError as e:
        return f"kv_transfer's NCCL transport does not import here: {e}"
    return NcclTransport.unavailable_reason()


def check_nccl_handoff(path: Path) -> Check:
    """Prefill ``path``'s model on GPU 0, move its KV over NCCL to a decode engine (GPU 1 where
    there is one), decode there, and compare with the colocated run."""
    why = _unavailable()
    if why is not None:
        return Check("nccl", "prefill->decode handoff", "skip", reason=why)
    from engine.engine import Engine
    from engine.runner import DecodeSeq, PrefillChunk
    from kv_transfer.blocks import direct_views, run_lengths, source_tensors

    gpus = torch.cuda.device_count()
    src_dev, dst_dev = "cuda:0", ("cuda:1" if gpus > 1 else "cuda:0")
    pre = Engine.from_dir(path, engine_config(src_dev, "float32", "torch", True, num_blocks=64))
    with torch.cuda.device(dst_dev):  # as a decode replica, whose one GPU is its current device
        dec = Engine.from_dir(path, engine_config(dst_dev, "float32", "torch", True, num_blocks=64))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 256, (100,), generator=g).tolist()
    n_prompt_blocks = pre.blocks_for(len(prompt))
    src_blocks = pre.pool.allocate(n_prompt_blocks)
    spread = dec.pool.allocate(2 * n_prompt_blocks)
    dst_blocks = spread[::2]  # every run has length 1: the most fragmented destination
    dec.pool.free(spread[1::2])
    dst_blocks += dec.pool.allocate(dec.blocks_for(len(prompt) + N_NEW) - n_prompt_blocks)
    try:
        logits = pre.runner.prefill([PrefillChunk(prompt, 0, src_blocks)])  # [1, V]
        out = [int(logits[0].argmax())]
        src = source_tensors(pre.cache, src_blocks, run_lengths(dst_blocks[:n_prompt_blocks]))
        dst = direct_views(dec.cache, dst_blocks[:n_prompt_blocks])
        t0 = time.perf_counter()
        how = _in_thread(src, dst, TIMEOUT_S + 30)
        transfer_s = time.perf_counter() - t0
        if how is None:
            return Check("nccl", "prefill->decode handoff", "fail", {"gpus": gpus, "waited_s": transfer_s},
                         reason="the NCCL transfer did not return (communicator init or send/recv hung)")
        same_bytes = torch.equal(pre.cache.gather_blocks(src_blocks).cpu(),
                                 dec.cache.gather_blocks(dst_blocks[:n_prompt_blocks]).cpu())
        with torch.cuda.device(dst_dev):
            for pos in range(len(prompt), len(prompt) + N_NEW - 1):
                out.append(int(dec.runner.decode([DecodeSeq(out[-1], pos, dst_blocks)])[0].argmax()))
    finally:
        pre.pool.free(src_blocks)
        dec.pool.free(dst_blocks)
    colocated = engine_greedy(pre, tuple(prompt), N_NEW)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    figures: dict[str, Any] = {"gpus": gpus, "tensors": len(src), "bytes": nbytes, "transfer_s": transfer_s,
                               "kv_bytes_equal": same_bytes,
                               "tokens_equal": out == colocated, "path": how}
    if not same_bytes or out != colocated:
        return Check("nccl", "prefill->decode handoff", "fail", figures,
                     reason="the received KV differs from the sent blocks" if not same_bytes
                     else "decoding after the hand-off diverges from the colocated run")
    return Check("nccl", "prefill->decode handoff", "pass", figures)
