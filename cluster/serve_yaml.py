"""Reading a Serve YAML: the one application in it that runs pdserve, and its ``args:``.

Owns: `IMPORT_PATH` (how a Serve config names pdserve's app builder), `ConfigError` (a config that
cannot be used; the message says where and why) and `application_entry` / `application_args`.
Invariant: a file that cannot be read, is not YAML or holds no single pdserve application is a
`ConfigError` naming the file, never a partial result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

IMPORT_PATH = "cluster.app:build_app"


class ConfigError(ValueError):
    """A cluster config that cannot be used; the message says where and why."""


def application_args(path: str | Path) -> dict[str, Any]:
    """The ``args:`` of the pdserve application in a Serve YAML (the one importing `IMPORT_PATH`)."""
    app = application_entry(path)
    args = app.get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{path}: the application's args must be a mapping")
    return args


def application_entry(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"{p}: expected a Serve config with an 'applications:' list")
    ours = [a for a in apps if isinstance(a, dict) and a.get("import_path") == IMPORT_PATH]
    if len(ours) != 1:
        raise ConfigError(f"{p}: expected exactly one application with import_path: {IMPORT_PATH}")
    return ours[0]
