"""This node's identity on the cluster network: the address peers reach, and a readable id."""

from __future__ import annotations

import os
import re
import socket


def node_ip() -> str:
    """This node's address as its hostname resolves (what peers on the cluster network reach)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise ValueError(f"cannot resolve this node's IP ({e}); configure the host explicitly") from None


def default_node_id(role: str) -> str:
    """``<role>-<hostname>-<pid>``, within the id alphabet of `wire.ID_RE`."""
    return re.sub(r"[^A-Za-z0-9._:\-]", "-", f"{role}-{socket.gethostname()}-{os.getpid()}")[:128]
