"""Choosing the master port: 29500 unless it is busy and the user did not ask for it."""

from __future__ import annotations

import socket

DEFAULT_PORT = 29500


def port_is_free(port: int) -> bool:
    # Probe the wildcard address: torch's TCPStore binds all interfaces, so a listener on any of
    # them makes the agent fail. SO_REUSEADDR ignores TIME_WAIT leftovers, as the TCPStore does.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
