"""Separate "hosts" on this one machine, for launcher tests that ssh to other hosts.

Each host is a Linux network namespace with its own loopback, its own address on a private /24 and
its own sshd (key authentication only). The namespaces hang off one Linux bridge in the root
namespace, so host-to-host traffic really crosses veth links and the test process (root namespace)
reaches every host's sshd. The filesystem and the PID namespace stay shared: the same checkout and
venv are visible on every host, and a test can see (and the teardown kill) what runs "on" a host.
The UTS namespace is shared too: every host has this machine's hostname, so tests name hosts by
their addresses (Hosts.addrs). Inside a host the interface is "eth0", with a default route via the
bridge, so "which interface reaches the master" logic sees what it sees on a real node.

Usage (needs root, iproute2 and openssh-server; skip otherwise)::

    reason = why_no_separate_hosts()
    if reason:
        pytest.skip(reason)
    with separate_hosts(2, tmp_path) as hosts:
        hosts.ssh(0, "hostname")                      # or: ssh -F hosts.ssh_config ADDR cmd
        subprocess.run(["ssh", *hosts.ssh_args, hosts.addrs[1], "true"])

Names are unique per test process (its pid) and per call, and leftovers of crashed runs (whose pid is
gone) are removed first, so concurrent or earlier runs do not collide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Private subnets are picked inside 10.200.0.0 .. 10.250.255.0: far from the 10.0.x / 10.1.x ranges
# that clouds, docker and VPNs usually take, and still checked against the routing table.
_SUBNET_FIRST = ipaddress.IPv4Network("10.200.0.0/24")
_SUBNET_COUNT = 51 * 256
# Host i gets .(11 + i); .1 is the bridge (the root namespace's address on the private net).
_FIRST_HOST = 11
# Name prefixes: bridge, root-side veth end, namespace. The owner's pid (hex) follows, then "-",
# so leftovers of a dead owner can be recognised and removed.
_BRIDGE, _VETH, _NETNS = "shb", "shv", "shn"
_STALE = re.compile(rf"^(?:{_BRIDGE}|{_VETH}|{_NETNS})([0-9a-f]+)-")
_IFNAMSIZ = 15  # longest Linux interface name
_SSHD_START_TIMEOUT = 10.0
_KILL_TIMEOUT = 5.0
_CMD_TIMEOUT = 30.0

_calls = itertools.count()  # several separate_hosts() in one process get distinct names


class SeparateHostsError(RuntimeError):
    """Building or tearing down the hosts failed; the message names the step and its stderr."""


class HostCommandError(SeparateHostsError):
    """A command run on (or ssh'ed into) a host failed; names the host, the command and its stderr."""

    def __init__(self, host: int, addr: str, argv: list[str], result: subprocess.CompletedProcess[str]) -> None:
        self.host, self.addr, self.argv, self.result = host, addr, argv, result
        super().__init__(
            f"host {host} ({addr}): {subprocess.list2cmdline(argv)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )


def _run(argv: list[str], what: str) -> str:
    """Run a setup command; a failure raises naming `what`, the command and its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SeparateHostsError(f"{what}: {subprocess.list2cmdline(argv)} failed: {exc}") from exc
    if done.returncode != 0:
        raise SeparateHostsError(
            f"{what}: {subprocess.list2cmdline(argv)} exited {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _quiet(argv: list[str]) -> None:
    """Run a cleanup command whose failure is expected when the thing is already gone."""
    subprocess.run(argv, capture_output=True, timeout=_CMD_TIMEOUT, check=False)


def _sshd() -> str | None:
    # sbin is often not on a test runner's PATH.
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)


@functools.cache
def why_no_separate_hosts() -> str | None:
    """Why separate hosts cannot be built here (to pass to pytest.skip), or None when they can.

    Checks the cheap things first (root, tools), then really adds and deletes a namespace and a bridge:
    containers often have the tools but not the capability (CAP_NET_ADMIN, /run/netns mounts).
    """
    if os.geteuid() != 0:
        return "separate hosts need root (network namespaces, a bridge, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"separate hosts need `{tool}` (iproute2 / openssh-client) on PATH"
    if _sshd() is None:
        return "separate hosts need sshd (openssh-server)"
    probe = f"shp{os.getpid():x}"
    try:
        _run(["ip", "netns", "add", probe], "probe: add a network namespace")
        _run(["ip", "link", "add", probe, "type", "bridge"], "probe: add a bridge")
    except SeparateHostsError as exc:
        return f"separate hosts cannot be built here: {exc}"
    finally:
        _quiet(["ip", "link", "del", probe])
        _quiet(["ip", "netns", "del", probe])
    return None


# ---------------------------------------------------------------- naming and addresses


@dataclasses.dataclass(frozen=True)
class _Names:
    bridge: str
    veths: list[str]  # root-namespace ends; the other end is "eth0" inside each namespace
    netns: list[str]


def _names(n: int, call: int) -> _Names:
    tag = f"{os.getpid():x}-{call:x}"
    names = _Names(
        bridge=f"{_BRIDGE}{tag}",
        veths=[f"{_VETH}{tag}-{i:x}" for i in range(n)],
        netns=[f"{_NETNS}{tag}-{i:x}" for i in range(n)],
    )
    for link in (names.bridge, *names.veths):
        if len(link) > _IFNAMSIZ:
            raise SeparateHostsError(f"interface name {link!r} is longer than {_IFNAMSIZ} chars (too many hosts?)")
    return names


# Routes of these types name their type before the destination ("local 10.0.0.1 dev ...").
_ROUTE_TYPES = {
    "unicast",
    "local",
    "broadcast",
    "multicast",
    "anycast",
    "unreachable",
    "blackhole",
    "prohibit",
    "throw",
    "nat",
}


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination in every routing table (addresses in use show up in the local table)."""
    nets = []
    for line in _run(["ip", "-4", "route", "show", "table", "all"], "list routes").splitlines():
        words = line.split()
        dest = words[1] if words and words[0] in _ROUTE_TYPES and len(words) > 1 else (words or ["default"])[0]
        if dest == "default":  # a default route overlaps everything and says nothing about use
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def _pick_subnet(call: int) -> ipaddress.IPv4Network:
    """A /24 that no route touches, starting at one derived from our pid so concurrent runs spread out."""
    used = _routed_networks()
    # Spaced by pid so that neighbouring pids (pytest-xdist workers) do not start on each other's
    # subnets when each builds hosts several times.
    start = (os.getpid() * 64 + call) % _SUBNET_COUNT
    for k in range(_SUBNET_COUNT):
        base = _SUBNET_FIRST.network_address + 256 * ((start + k) % _SUBNET_COUNT)
        net = ipaddress.IPv4Network(f"{base}/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise SeparateHostsError("no free /24 in 10.200.0.0-10.250.255.255")


# ---------------------------------------------------------------- leftovers and teardown


def _ns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False).stdout
    return sorted(int(p) for p in out.split())


def _kill_all(netns: str) -> list[int]:
    """SIGKILL everything in the namespace until nothing is left (killed parents may have forked);
    returns the survivors, if any, after the timeout."""
    deadline = time.monotonic() + _KILL_TIMEOUT
    while (pids := _ns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return pids


def _delete_netns(netns: str) -> None:
    # `ip netns del` with processes inside only drops the name: the namespace (and its veth end)
    # would live on with them, so they go first.
    survivors = _kill_all(netns)
    _quiet(["ip", "netns", "del", netns])
    if survivors:
        raise SeparateHostsError(f"namespace {netns}: processes {survivors} survived SIGKILL")


def _delete_link(name: str) -> None:
    _quiet(["ip", "link", "del", name])


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _reap_stale() -> None:
    """Remove namespaces and links left by crashed runs: our name prefix with an owner pid that is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for netns in (line.split()[0] for line in listed.splitlines() if line.strip()):
        if (m := _STALE.match(netns)) and not _alive(int(m.group(1), 16)):
            with contextlib.suppress(SeparateHostsError):
                _delete_netns(netns)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if (m := _STALE.match(name)) and not _alive(int(m.group(1), 16)):
            _delete_link(name)


# ---------------------------------------------------------------- bridge filtering


def _bridge_netfilter(bridge: str, stack: contextlib.ExitStack) -> str | None:
    """With br_netfilter loaded and bridge-nf-call-iptables=1, frames between bridge ports pass the
    iptables FORWARD chain (and frames to the bridge's own address INPUT), where a DROP policy would cut
    host-to-host traffic. Accept rules for our bridge are added (and removed on exit) when iptables
    exists. Returns a note on what was found/done, None when nothing filters bridged traffic."""
    flag = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not flag.exists() or flag.read_text().strip() != "1":
        return None
    if shutil.which("iptables") is None:
        return "bridge-nf-call-iptables=1 but no iptables command: no accept rules added (traffic is checked)"
    for rule in (["FORWARD", "-i", bridge, "-o", bridge], ["INPUT", "-i", bridge]):
        _run(["iptables", "-w", "-I", *rule, "-j", "ACCEPT"], f"bridge {bridge}: add iptables accept rule")
        stack.callback(_quiet, ["iptables", "-w", "-D", *rule, "-j", "ACCEPT"])
    return "bridge-nf-call-iptables=1: iptables FORWARD/INPUT accept rules added for the bridge"


# ---------------------------------------------------------------- sshd


def _sshd_config(d: Path, addr: str, port: int, host_key: Path, authorized: Path) -> str:
    return "\n".join(
        [
            f"Port {port}",
            f"ListenAddress {addr}",
            f'HostKey "{host_key}"',
            f'AuthorizedKeysFile "{authorized}"',
            f'PidFile "{d / "sshd.pid"}"',
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # No PAM: no login session setup (pam_systemd, motd) to slow or break sessions in a namespace.
            "UsePAM no",
            # The key files live in pytest's tmp dir, whose modes sshd's strict checks would refuse.
            "StrictModes no",
            "UseDNS no",
            # Launchers open one connection per host or rank at once; the defaults (10 unauthenticated,
            # 10 sessions per connection) would make sshd drop some.
            "MaxStartups 200",
            "MaxSessions 200",
            "LogLevel VERBOSE",
            "",
        ]
    )


def _wait_listening(host: int, addr: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll a TCP connect from the root namespace until sshd answers with its banner, or raise with
    sshd's log."""
    deadline = time.monotonic() + _SSHD_START_TIMEOUT
    while True:
        with contextlib.suppress(OSError), socket.create_connection((addr, port), timeout=1) as conn:
            if conn.recv(4) == b"SSH-":
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            state = f"exited {proc.returncode}" if proc.returncode is not None else "did not answer"
            raise SeparateHostsError(
                f"host {host} ({addr}:{port}): sshd (pid {proc.pid}) {state} within {_SSHD_START_TIMEOUT:.0f}s; "
                f"its log {log}:\n{log.read_text(errors='replace')}"
            )
        time.sleep(0.02)


# Runs inside host 0: reads each other host's sshd banner, i.e. traffic that crosses the bridge.
_CROSS_PROBE = """
import socket, sys
port = int(sys.argv[1])
for addr in sys.argv[2:]:
    with socket.create_connection((addr, port), timeout=5) as conn:
        assert conn.recv(4) == b"SSH-", addr
"""


def _check_crossing(hosts: Hosts, port: int) -> None:
    """Host 0 must reach the other hosts' sshd: the root namespace reaching each of them does not prove
    it, as bridged traffic between ports can be filtered (br_netfilter) while traffic to the bridge
    itself is not. Fails here, naming the cause, rather than as a hung launcher later."""
    if len(hosts.addrs) < 2:
        return
    try:
        hosts.exec(0, [sys.executable, "-I", "-S", "-c", _CROSS_PROBE, str(port), *hosts.addrs[1:]], timeout=30)
    except HostCommandError as exc:
        raise SeparateHostsError(
            f"host 0 cannot reach the other hosts' sshd across bridge {hosts.bridge} "
            f"({hosts.netfilter_note or 'no bridge filtering found'}): {exc.result.stderr.strip()}"
        ) from exc


def _stop(proc: subprocess.Popen[Any]) -> None:
    """Stop a child we started, and reap it so no zombie stays behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_KILL_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the hosts


@dataclasses.dataclass
class Hosts:
    """The built hosts. Host i is namespace netns[i] with address addrs[i]; reach it with
    `ssh -F ssh_config addrs[i] cmd` (ssh_args holds the `-F` part, for launchers' ssh options)."""

    addrs: list[str]  # usable as hostfile names
    netns: list[str]
    ssh_config: Path  # key, user root, port, no host key checks, batch mode
    ssh_args: list[str]  # ["-F", str(ssh_config)]
    subnet: ipaddress.IPv4Network
    gateway: str  # the root namespace's address on the hosts' subnet (the bridge)
    bridge: str
    sshd_pids: list[int]  # each host's sshd listener
    netfilter_note: str | None  # what was found/done about bridge filtering, None if nothing filters
    _children: list[subprocess.Popen[Any]] = dataclasses.field(default_factory=list, repr=False)

    def pids(self, i: int) -> list[int]:
        """The processes now running "on" host i (in its namespace), its sshd listener left out, so a
        test can assert that nothing survives there."""
        return [pid for pid in _ns_pids(self.netns[i]) if pid != self.sshd_pids[i]]

    def wait_idle(self, i: int, timeout: float = 5.0) -> list[int]:
        """Wait until nothing but sshd runs on host i; returns what is still there after `timeout`
        (empty when idle). ssh sessions end a moment after the client returns, hence the wait."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids(i)) and time.monotonic() < deadline:
            time.sleep(0.02)
        return pids

    def exec(self, i: int, argv: list[str], *, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run argv inside host i's namespace (ip netns exec), bypassing ssh; output captured as text
        unless kw says otherwise. check=True raises HostCommandError naming the host and the stderr."""
        full = ["ip", "netns", "exec", self.netns[i], *argv]
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        result = subprocess.run(full, check=False, **kw)
        if check and result.returncode != 0:
            raise HostCommandError(i, self.addrs[i], argv, result)
        return result

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start argv in the background on host i (ip netns exec); it is killed and reaped on exit."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns[i], *argv], **kw)
        self._children.append(proc)
        return proc

    def ssh(self, i: int, command: str, *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run a shell command on host i over ssh from the root namespace, as a launcher would."""
        argv = ["ssh", *self.ssh_args, self.addrs[i], command]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise HostCommandError(i, self.addrs[i], argv, result)
        return result

    def _reap_children(self) -> None:
        for proc in self._children:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def _name_service(netns: str, addrs: list[str], undo: Callable[..., Any]) -> None:
    """Files `ip netns exec` binds over /etc/hosts and /etc/resolv.conf for everything on the host.

    The machine's name server is not reachable from the hosts' subnet: every reverse lookup (torch's
    TCPStore does one per client) would wait for its 10 s timeout. The hosts know each other by
    /etc/hosts, and the resolver asks the host's own loopback, where nothing listens: an instant no.
    """
    d = Path("/etc/netns") / netns
    d.mkdir(parents=True, exist_ok=True)
    undo(shutil.rmtree, d, True)
    (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} host{k}\n" for k, a in enumerate(addrs)))
    (d / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def _keygen(path: Path) -> None:
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "separate-hosts", "-f", str(path)], "ssh-keygen")


def _add_host(i: int, names: _Names, addr: str, gateway: str, prefixlen: int, undo: Callable[..., Any]) -> None:
    """Namespace + veth (root end in the bridge, "eth0" inside) + address, lo and default route."""
    netns, veth, what = names.netns[i], names.veths[i], f"host {i} ({addr})"
    _delete_link(veth)  # tolerate a leftover of ours (same pid and call number): start clean
    _delete_netns(netns)
    _run(["ip", "netns", "add", netns], f"{what}: add namespace")
    undo(_delete_netns, netns)
    _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns], f"{what}: add veth")
    undo(_delete_link, veth)
    _run(["ip", "link", "set", veth, "master", names.bridge, "up"], f"{what}: attach veth to bridge")
    _run(["ip", "-n", netns, "addr", "add", f"{addr}/{prefixlen}", "dev", "eth0"], f"{what}: add address")
    _run(["ip", "-n", netns, "link", "set", "eth0", "up"], f"{what}: eth0 up")
    _run(["ip", "-n", netns, "link", "set", "lo", "up"], f"{what}: lo up")
    # Programs that find "my address" by routing towards a public address need a default route.
    _run(["ip", "-n", netns, "route", "add", "default", "via", gateway], f"{what}: default route")


def _start_sshd(
    i: int, netns: str, addr: str, port: int, d: Path, host_key: Path, authorized: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """sshd -D (no daemonizing: it stays our child, stopped by pid), -e (log to its log file)."""
    d.mkdir()
    config = d / "sshd_config"
    config.write_text(_sshd_config(d, addr, port, host_key, authorized))
    sshd = _sshd()
    assert sshd is not None  # why_no_separate_hosts checked
    _run([sshd, "-t", "-f", str(config)], f"host {i} ({addr}): sshd config check")
    log = d / "sshd.log"
    with log.open("wb") as out:
        # `ip netns exec` execs sshd in place, so proc.pid is sshd's pid. Its own session: a Ctrl-C
        # meant for pytest does not hit it before the teardown does.
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sshd, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def _ssh_config(path: Path, key: Path, port: int) -> None:
    path.write_text(
        "\n".join(
            [
                "Host *",
                f'  IdentityFile "{key}"',
                "  IdentitiesOnly yes",
                "  User root",
                f"  Port {port}",
                # Every run has fresh host keys: no checks, nothing written to known_hosts.
                "  StrictHostKeyChecking no",
                "  UserKnownHostsFile /dev/null",
                "  GlobalKnownHostsFile /dev/null",
                "  LogLevel ERROR",
                "  BatchMode yes",
                "  ConnectTimeout 10",
                "",
            ]
        )
    )


@contextlib.contextmanager
def separate_hosts(n: int, tmp_path: Path, ssh_port: int = 22) -> Iterator[Hosts]:
    """Build n separate hosts, each with a running sshd accepting the test key; yields Hosts.

    On exit (also after a failure, also half-way through building) everything still running on the
    hosts is killed, sshd stopped, and namespaces, veths, bridge and any iptables rules removed.
    Call why_no_separate_hosts() first and skip when it gives a reason.
    """
    if reason := why_no_separate_hosts():
        raise SeparateHostsError(reason)
    _reap_stale()
    with contextlib.ExitStack() as stack:  # undo actions, run last-in first-out
        undo = stack.callback
        call = next(_calls)
        names = _names(n, call)
        subnet = _pick_subnet(call)
        gateway = str(subnet.network_address + 1)
        addrs = [str(subnet.network_address + _FIRST_HOST + i) for i in range(n)]
        if n < 1 or _FIRST_HOST + n >= subnet.num_addresses - 1:
            raise SeparateHostsError(f"cannot build {n} hosts on one /24")

        work = tmp_path / f"separate_hosts-{names.bridge}"
        work.mkdir(parents=True)
        host_key, client_key = work / "host_ed25519", work / "id_ed25519"
        _keygen(host_key)
        _keygen(client_key)
        authorized = work / "authorized_keys"
        authorized.write_text(client_key.with_suffix(".pub").read_text())
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation dir

        _delete_link(names.bridge)
        _run(["ip", "link", "add", names.bridge, "type", "bridge"], f"bridge {names.bridge}: add")
        undo(_delete_link, names.bridge)
        _run(["ip", "addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", names.bridge], "bridge: add address")
        _run(["ip", "link", "set", names.bridge, "up"], "bridge: up")
        netfilter_note = _bridge_netfilter(names.bridge, stack)

        sshds: list[tuple[subprocess.Popen[bytes], Path]] = []
        for i in range(n):
            _add_host(i, names, addrs[i], gateway, subnet.prefixlen, undo)
            _name_service(names.netns[i], addrs, undo)
            proc, log = _start_sshd(i, names.netns[i], addrs[i], ssh_port, work / f"host{i}", host_key, authorized)
            undo(_stop, proc)
            sshds.append((proc, log))
        for i, (proc, log) in enumerate(sshds):
            _wait_listening(i, addrs[i], ssh_port, proc, log)

        ssh_config = work / "ssh_config"
        _ssh_config(ssh_config, client_key, ssh_port)
        hosts = Hosts(
            addrs=addrs,
            netns=names.netns,
            ssh_config=ssh_config,
            ssh_args=["-F", str(ssh_config)],
            subnet=subnet,
            gateway=gateway,
            bridge=names.bridge,
            sshd_pids=[proc.pid for proc, _ in sshds],
            netfilter_note=netfilter_note,
        )
        undo(hosts._reap_children)
        _check_crossing(hosts, ssh_port)
        # The readiness probes made each sshd fork a connection handler; let those end, so that
        # pids() starts out empty.
        for i in range(n):
            hosts.wait_idle(i)
        yield hosts
