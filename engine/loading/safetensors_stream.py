"""Writing a safetensors file one tensor at a time, so a conversion never holds the whole model.

Owns: `SafetensorsStream`, which writes the header for a list of `TensorSpec` up front (names,
dtypes, shapes: all the format's header needs) and then each tensor's bytes in that order, as
it is produced. ``safetensors.torch.save_file`` takes every tensor at once and copies each into
bytes before writing: twice the model in memory.

Invariants: the file is the safetensors format (an 8-byte little-endian header length, a JSON
header padded with spaces to a multiple of 8, the tensors' bytes back to back in header order), so
`safetensors.safe_open` reads it; a tensor that does not match its spec (name, dtype, shape, order)
raises ValueError before anything of it is written; `close` refuses a file missing tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsStream:
    """``with SafetensorsStream(path, specs) as out: out.write(name, tensor)`` for each spec, in order."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for s in specs:
            if s.dtype not in _NAMES:
                raise ValueError(f"{s.name}: dtype {s.dtype} cannot be written; expected one of {list(_NAMES)}")
            header[s.name] = {"dtype": _NAMES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._specs = list(specs)
        self._next = 0
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close / __exit__)
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's bytes; it must be the next spec's name, dtype and shape."""
        if self._next >= len(self._specs):
            raise ValueError(f"{name}: every tensor of the header is written already")
        s = self._specs[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (s.name, s.dtype, s.shape):
            raise ValueError(f"expected {s.name} {s.dtype} {s.shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        t = tensor.detach().cpu().contiguous()
        self._file.write(t.view(torch.uint8).numpy().data if t.numel() else b"")
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._specs):
            raise ValueError(f"{len(self._specs) - self._next} tensors of the header were not written")

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
