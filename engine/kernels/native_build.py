"""Building the engine's C++ kernels (``engine/kernels/csrc/*.cpp``) for this machine, on first use.

Owns: compiling one source with the system C++ compiler (``$CXX``, else ``c++``) into a shared
library cached under ``~/.cache/pdserve/native`` (``PDSERVE_NATIVE_CACHE`` overrides), loading it
with ctypes, and `NativeUnavailable`, the reason a kernel cannot run here. Used by
`engine.kernels.native_attention` and `engine.kernels.native_linear`; each caches its own loaded library.

Invariants: a library's name carries a hash of its source and the local headers it includes, the
flags, the compiler's version and this CPU's flags (``-march=native``), so a stale or foreign build
is never loaded; it is written to
a temporary name and renamed, so concurrent processes never load a half-written file; a failed
build leaves nothing behind. No ``-ffast-math``: its crtfastmath.o sets flush-to-zero /
denormals-are-zero for the whole process when the library loads (`test_native_attention` checks
that subnormals survive). The kernels use OpenMP and share torch's runtime (same ``libgomp.so.1``
soname); ctypes releases the GIL for every call.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here (no compiler, a compile error); the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_NATIVE_CACHE") or Path.home() / ".cache" / "pdserve" / "native")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _sources(source: Path) -> list[str]:
    """The text of ``source`` and of every local header it includes (``#include "x.h"``, recursively,
    each once): what the build's hash covers, so editing a header rebuilds every kernel that uses it."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        todo += [path.parent / m for m in _LOCAL_INCLUDE.findall(path.read_text())]
    return [p.read_text() for p in seen]


def build(source: Path) -> ctypes.CDLL:
    """``source`` compiled for this machine (the first time in any process, then reused) and loaded."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler {cxx!r} on PATH")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{cxx} --version failed: {e}") from e
    key = hashlib.sha256("\n".join([*_sources(source), " ".join(FLAGS), version, _cpu_flags(),
                                     platform.machine()]).encode())
    out = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            run = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                raise NativeUnavailable(f"{cxx} failed: {run.stderr.strip()[-500:]}")
            os.replace(tmp, out)
        except subprocess.SubprocessError as e:
            raise NativeUnavailable(f"{cxx} did not finish: {e}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {out}: {e}") from e


def unavailable_reason(load: Callable[[], object]) -> str | None:
    """None if ``load()`` builds and loads its kernel here, else why not."""
    try:
        load()
    except NativeUnavailable as e:
        return str(e)
    return None


def build_with(source: Path, names: Sequence[str], argtypes: Sequence[type]) -> ctypes.CDLL:
    """`build` ``source`` and declare each of ``names`` with ``argtypes`` and no result."""
    lib = build(source)
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(argtypes), None
    return lib


def build_with_or_none(source: Path, names: Sequence[str], argtypes: Sequence[type]) -> ctypes.CDLL | None:
    """`build_with`, or None where the kernel cannot be built here (for callers with a torch fallback)."""
    try:
        return build_with(source, names, argtypes)
    except NativeUnavailable:
        return None
