"""DeepSpeed's hostfile and --include/--exclude syntax (`host slots=N`, `host1@host2:0,2`)."""

from __future__ import annotations

import re
import socket
from collections import OrderedDict
from collections.abc import Sequence

from launcher.config import Host
from launcher.errors import LaunchError

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Host names reach ssh's argv and remote shells: letters, digits, '.', '_' and '-' only, and never a
# leading '-' (ssh would read `-oProxyCommand=...` as an option).
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def check_host_name(name: str, where: str) -> None:
    if not _HOST_NAME.fullmatch(name):
        raise LaunchError(
            f"{where}: {name!r} is not a host name; hint: use a DNS name or an IPv4 address "
            f"(letters, digits, '.', '_', '-'; not starting with '-')"
        )


def is_local_host(name: str) -> bool:
    return name in LOCAL_NAMES or name == socket.gethostname()


def parse_hostfile(text: str, path: str) -> OrderedDict[str, int]:
    hosts: OrderedDict[str, int] = OrderedDict()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise LaunchError(
                f"{path}:{lineno}: bad hostfile line {raw.strip()!r}; hint: each line is 'hostname slots=N'"
            )
        check_host_name(parts[0], f"{path}:{lineno}")
        if int(parts[1][6:]) < 1:
            raise LaunchError(f"{path}:{lineno}: host {parts[0]!r} has slots=0; hint: slots must be >= 1")
        if parts[0] in hosts:
            raise LaunchError(f"{path}:{lineno}: host {parts[0]!r} is listed twice; hint: list each host once")
        hosts[parts[0]] = int(parts[1][6:])
    if not hosts:
        raise LaunchError(f"{path}: the hostfile lists no hosts; hint: add a line 'localhost slots=N'")
    return hosts


def _parse_spec(spec: str, flag: str) -> OrderedDict[str, list[int] | None]:
    """`host1@host2:0,2` -> {host1: None (all slots), host2: [0, 2]}."""
    out: OrderedDict[str, list[int] | None] = OrderedDict()
    for item in spec.split("@"):
        name, _, ids = item.partition(":")
        if not name:
            raise LaunchError(f"{flag} {spec!r}: empty host name; hint: use 'host1@host2:0,2'")
        try:
            out[name] = [int(i) for i in ids.split(",")] if ids else None
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slot ids must be integers; hint: use 'host:0,2'") from None
    return out


def select_slots(hosts: OrderedDict[str, int], include: str | None, exclude: str | None) -> OrderedDict[str, list[int]]:
    """Apply --include or --exclude to the hostfile's hosts, keeping hostfile order."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; hint: use one of them")
    selected: OrderedDict[str, list[int]] = OrderedDict((h, list(range(n))) for h, n in hosts.items())
    if include:
        wanted = _parse_spec(include, "--include")
        for name, ids in wanted.items():
            if name not in hosts:
                raise LaunchError(f"--include names host {name!r}, which is not in the hostfile")
            bad = [i for i in ids or [] if not 0 <= i < hosts[name]]
            if bad:
                raise LaunchError(f"--include: host {name!r} has no slot(s) {bad} (slots={hosts[name]})")
        selected = OrderedDict((h, (wanted[h] or s)) for h, s in selected.items() if h in wanted)
    if exclude:
        for name, ids in _parse_spec(exclude, "--exclude").items():
            if name not in selected:
                raise LaunchError(f"--exclude names host {name!r}, which is not in the hostfile")
            if ids is None:
                del selected[name]
            else:
                selected[name] = [i for i in selected[name] if i not in ids]
        selected = OrderedDict((h, s) for h, s in selected.items() if s)
    if not selected:
        raise LaunchError("--include/--exclude left no slots to run on")
    return selected


def format_world(hosts: Sequence[Host]) -> str:
    """The world in --include syntax with explicit slots (`h1:0,1@h2:0,1`): one argv word, no spaces."""
    return "@".join(f"{h.name}:{','.join(str(s) for s in h.slots)}" for h in hosts)


def parse_world(spec: str) -> tuple[Host, ...]:
    hosts = []
    for name, ids in _parse_spec(spec, "--world").items():
        check_host_name(name, "--world")
        if not ids:
            raise LaunchError(f"--world {spec!r}: host {name!r} has no slots; hint: use 'host:0,1'")
        hosts.append(Host(name, tuple(ids)))
    return tuple(hosts)
