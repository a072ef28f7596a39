"""Smoke test of tests/separate_hosts.py: the hosts are really separate (own address, own loopback),
reach each other over the bridge, are reached by ssh, and leave nothing behind."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from separate_hosts import SeparateHostsError, separate_hosts, why_no_separate_hosts

PORT = 5555  # any port: each host has its own, empty port space

# Runs on host 0 over ssh: which network namespace, which of the two addresses are local, and what a
# connection to host 1's address and to this host's own 127.0.0.1 gets.
PROBE = """
import json, os, socket, sys
mine, other, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def bindable(addr):
    try:
        socket.socket().bind((addr, 0))
        return True
    except OSError:
        return False
def fetch(addr):
    try:
        with socket.create_connection((addr, port), timeout=5) as s:
            return s.makefile().readline().strip()
    except ConnectionRefusedError:
        return "refused"
print(json.dumps({"netns": os.readlink("/proc/self/ns/net"), "mine": bindable(mine), "other": bindable(other),
                  "remote": fetch(other), "loopback": fetch("127.0.0.1")}))
"""

# Runs on host 1: answers on its address and on its own loopback, saying which one was reached.
LISTENER = """
import socket, sys, threading
def serve(addr, port):
    server = socket.create_server((addr, port))
    while True:
        conn, _ = server.accept()
        conn.sendall(f"host1 {addr}\\n".encode())
        conn.close()
for addr in sys.argv[1:3]:
    threading.Thread(target=serve, args=(addr, int(sys.argv[3])), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture(autouse=True)
def _need_separate_hosts() -> None:
    reason = why_no_separate_hosts()
    if reason:
        print(reason)
        pytest.skip(reason)


def _netns_inode(name: str) -> str:
    return f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"


def _gone(names: list[str], sshd_pids: list[int]) -> None:
    """No namespace, link or sshd of the hosts is left."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    present = {line.split()[0] for line in netns.splitlines() if line.strip()}
    present |= {line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line}
    assert not present & set(names)
    assert not [pid for pid in sshd_pids if Path(f"/proc/{pid}").exists()]


def test_two_hosts_are_separate_and_connected(tmp_path: Path) -> None:
    with separate_hosts(2, tmp_path) as hosts:
        print(f"subnet {hosts.subnet}, bridge {hosts.bridge}, netfilter: {hosts.netfilter_note}")
        addr0, addr1 = hosts.addrs
        assert hosts.pids(0) == hosts.pids(1) == []  # nothing but sshd runs on a fresh host
        listener = hosts.popen(
            1, [sys.executable, "-c", LISTENER, addr1, "127.0.0.1", str(PORT)], stdout=subprocess.PIPE
        )
        assert listener.stdout is not None and listener.stdout.readline() == b"ready\n"
        assert listener.pid in hosts.pids(1)  # pids() sees what runs on host 1

        probe = shlex.join([sys.executable, "-c", PROBE, addr0, addr1, str(PORT)])
        seen = json.loads(hosts.ssh(0, probe).stdout)
        assert seen["netns"] == _netns_inode(hosts.netns[0])  # ssh landed in host 0's namespace
        assert seen["mine"] and not seen["other"]  # host 0 has its address, not host 1's
        assert seen["remote"] == f"host1 {addr1}"  # host 0 -> host 1 across the veths and the bridge
        assert seen["loopback"] == "refused"  # host 1's 127.0.0.1 is not host 0's
        assert "inet 127.0.0.1/8" in hosts.exec(1, ["ip", "-4", "addr", "show", "lo"]).stdout
        assert hosts.wait_idle(0) == []  # the ssh session ended; only sshd is left on host 0

        names = [hosts.bridge, *hosts.netns]
        sshd_pids = hosts.sshd_pids
    # The listener on host 1 was still running: the teardown killed it.
    assert listener.returncode is not None
    _gone(names, sshd_pids)


def test_teardown_after_a_failure(tmp_path: Path) -> None:
    with pytest.raises(SeparateHostsError), separate_hosts(1, tmp_path) as hosts:
        names = [hosts.bridge, *hosts.netns]
        sshd_pids = hosts.sshd_pids
        hosts.ssh(0, "exit 3")  # raises HostCommandError naming the host
    _gone(names, sshd_pids)
