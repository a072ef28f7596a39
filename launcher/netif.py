"""Which network interface reaches the master: gloo's ranks must listen on it.

Without GLOO_SOCKET_IFNAME, gloo binds the address the machine's own hostname resolves to, which
on many hosts is 127.0.1.1 or an interface the other nodes cannot reach: the job then hangs or fails
in its first collective. The kernel's routing table already knows the right interface: connecting
a UDP socket (no packet is sent) to the master picks the source address, and that names it.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(packed[20:24])


def source_address(master_addr: str, port: int) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, port))
        return str(s.getsockname()[0])


def interface_towards(master_addr: str, port: int) -> str | None:
    """The interface name this host uses to reach master_addr, or None if it cannot tell."""
    try:
        local = source_address(master_addr, port)
    except OSError:  # unresolvable or unroutable: let gloo apply its own rules
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None
