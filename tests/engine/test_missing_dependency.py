"""`engine.errors.missing_dependency` and the packages imported on first use (gguf, llguidance,
psutil): where one is absent, the path that needs it fails with `MissingDependencyError` naming the
package and its install, and only that path (``tests/loadtests/test_gpu_check.py`` imports the rest
without them). A package is made absent as for one never installed: None in ``sys.modules``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.errors import EngineError, MissingDependencyError, missing_dependency
from engine.loading.bundled import prepare_model
from engine.memory import HostProbe
from engine.sampling.grammar import GrammarSpec, grammar_vocab


def absent(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_an_absent_package_is_named_with_its_install(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "psutil")
    with pytest.raises(MissingDependencyError) as info, missing_dependency("psutil", "sizing X"):
        import psutil  # noqa: F401
    err = info.value
    assert isinstance(err, ImportError) and isinstance(err, EngineError) and err.name == "psutil"
    assert str(err).startswith("sizing X needs the 'psutil' package") and "`pip install psutil`" in str(err)
    assert isinstance(err.__cause__, ModuleNotFoundError)


def test_another_import_error_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """An import that fails inside the named package's own imports (its dependency missing) is not
    reported as the package missing."""
    absent(monkeypatch, "msgpack")
    with pytest.raises(ModuleNotFoundError) as info, missing_dependency("psutil", "sizing X"):
        import msgpack  # noqa: F401
    assert not isinstance(info.value, MissingDependencyError) and info.value.name == "msgpack"


def test_the_host_probe_needs_psutil_only_when_it_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "psutil")
    probe = HostProbe()
    for measure in (probe.report, probe.allocated):
        with pytest.raises(MissingDependencyError, match="'psutil' package"):
            measure()


def test_a_grammar_needs_llguidance(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    absent(monkeypatch, "llguidance")
    spec = GrammarSpec("json_object")  # a spec is a plain value: it crosses Ray without llguidance
    with pytest.raises(MissingDependencyError, match=r"grammar \(response_format\) needs the 'llguidance'"):
        spec.llguidance_grammar()
    with pytest.raises(MissingDependencyError, match="'llguidance' package"):
        grammar_vocab(tmp_path, [0])  # a folder no other test used: not in the vocabulary cache


def test_converting_a_gguf_file_needs_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A folder loads without gguf; a ``.gguf`` file asks for it by name, and no cache entry is left."""
    absent(monkeypatch, "gguf")
    monkeypatch.delitem(sys.modules, "engine.loading.gguf_loader", raising=False)  # imported afresh
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert prepare_model(str(folder), cache_dir=tmp_path / "cache") == folder
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(MissingDependencyError, match=r"converting m\.gguf needs the 'gguf' package"):
        prepare_model(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache", progress=False)
    assert not any(p.name.startswith("m-") for p in (tmp_path / "cache").iterdir())
