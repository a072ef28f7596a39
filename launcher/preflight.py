"""Before any rank starts: is every host reachable, with the project and python, and the port free?

Run on the launching machine, `preflight_hosts` reaches each host the way the job will (ssh, or
directly for this machine) and runs `python -m launcher.preflight` there, in the job's directory.
Each failure becomes one line naming the host and the cause, instead of a rank dying mid-rendezvous.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from launcher.backends import ssh_argv
from launcher.config import LaunchConfig
from launcher.errors import LaunchError
from launcher.hostfile import is_local_host
from launcher.ports import port_is_free

NO_DIRECTORY, NO_PYTHON, NOT_IMPORTABLE, PORT_BUSY = 90, 91, 92, 93
TIMEOUT_S = 60


def _check_command(cwd: str, python: str, port: int | None) -> str:
    check = [python, "-m", "launcher.preflight", *(["--port", str(port)] if port is not None else [])]
    return (
        f"cd {shlex.quote(cwd)} || exit {NO_DIRECTORY}; "
        f"test -x {shlex.quote(python)} || exit {NO_PYTHON}; "
        f"exec {shlex.join(check)}"
    )


def _explain(host: str, rc: int, err: str, cfg: LaunchConfig, cwd: str, python: str) -> str:
    last = next((ln for ln in reversed(err.strip().splitlines()) if ln.strip()), "(no message)")
    port = f"-p {cfg.ssh_port} " if cfg.ssh_port else ""
    if rc == 255:
        return (
            f"[{host}] ssh failed: {last}; hint: `ssh {port}{host} true` must work without a prompt "
            f"(a key in the host's authorized_keys, its host key known or --launcher_args "
            f"'-o StrictHostKeyChecking=accept-new')"
        )
    if rc == NO_DIRECTORY:
        return (
            f"[{host}] the job's directory {cwd} does not exist there; hint: zrun runs every node in "
            f"the same directory: use a shared filesystem or the same checkout path on every host"
        )
    if rc == NO_PYTHON:
        return (
            f"[{host}] python {python} is missing there; hint: the same python (virtual environment) "
            f"path must exist on every host"
        )
    if rc == NOT_IMPORTABLE or "No module named" in err:
        return f"[{host}] the project is not importable there: {last}; hint: install it on every host"
    if rc == PORT_BUSY:
        return (
            f"[{host}] --master_port {cfg.master_port} is already in use on the master; "
            f"hint: pick another port with --master_port"
        )
    return f"[{host}] the check exited with code {rc}: {last}"


def _check_host(k: int, cfg: LaunchConfig, cwd: str, python: str) -> str | None:
    host = cfg.hosts[k].name
    command = _check_command(cwd, python, cfg.master_port if k == 0 else None)
    argv = ["sh", "-c", command] if is_local_host(host) else ssh_argv(cfg, host, command)
    try:
        r = subprocess.run(
            argv, check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"[{host}] no answer within {TIMEOUT_S} s; hint: check the host and its ssh daemon"
    return None if r.returncode == 0 else _explain(host, r.returncode, r.stderr, cfg, cwd, python)


def preflight_hosts(cfg: LaunchConfig, cwd: str, python: str) -> None:
    """Check every host in parallel; one LaunchError listing every host that failed."""
    with ThreadPoolExecutor(max_workers=min(32, len(cfg.hosts))) as pool:
        found = list(pool.map(lambda k: _check_host(k, cfg, cwd, python), range(len(cfg.hosts))))
    problems = [p for p in found if p]
    if problems:
        raise LaunchError("preflight found problems, no rank was started:\n  " + "\n  ".join(problems))


def main() -> int:
    """Run on a host: the project and torch import here, and (on the master) the port is free."""
    ap = argparse.ArgumentParser(prog="python -m launcher.preflight")
    ap.add_argument("--port", type=int, default=None)
    ns = ap.parse_args()
    try:
        import torch  # noqa: F401  (the ranks need it; a missing torch is the commonest surprise)
    except ImportError as e:
        print(f"cannot import torch: {e}", file=sys.stderr)
        return NOT_IMPORTABLE
    if ns.port is not None and not port_is_free(ns.port):
        return PORT_BUSY
    return 0


if __name__ == "__main__":
    sys.exit(main())
