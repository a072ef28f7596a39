"""LaunchConfig -> the per-node agent command (`python -m launcher.agent ...`, torch's agent). Pure.

The same argv runs on every node in the multi-node issue (over ssh/srun/mpirun), so it must not
depend on anything but the config, the node rank and the values passed in.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import NamedTuple

from launcher.config import LaunchConfig
from launcher.mirror import tee_spec
from launcher.threads import ThreadPlan, plan_threads

# The agent polls its workers this often: a failed rank is noticed within this many seconds.
MONITOR_INTERVAL_S = 0.1
# After one rank fails the agent SIGTERMs the others and SIGKILLs them after this long. torch's
# default is 30 s; a rank blocked in a collective must not keep the job alive that long.
SHUTDOWN_TIMEOUT_S = 5
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CONSOLE_ENV = "ZRUN_CONSOLE_IS_TERMINAL"


class AgentCommand(NamedTuple):
    argv: list[str]
    env: dict[str, str]  # only what zrun adds on top of the inherited environment
    threads: ThreadPlan


def build_agent_command(
    cfg: LaunchConfig,
    node_rank: int,
    log_dir: str,
    base_env: Mapping[str, str],
    cores: int,
    python: str = sys.executable,
) -> AgentCommand:
    if cfg.master_port is None:
        raise ValueError("build_agent_command needs a resolved master_port")
    nproc = len(cfg.hosts[node_rank].slots)
    argv = [
        python,
        "-m",
        "launcher.agent",  # torch.distributed.run's arguments; see launcher/agent.py for what it adds
        f"--nnodes={len(cfg.hosts)}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        # Static rendezvous: every node knows the master up front, as with DeepSpeed's launcher.
        f"--master-addr={cfg.master_addr}",
        f"--master-port={cfg.master_port}",
        f"--rdzv-id={cfg.run_id}",
        "--max-restarts=0",  # a failed rank fails the job; restarts are not DeepSpeed semantics
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
        # Per-rank log files so zrun can show the failed rank's last lines. Every rank's output is
        # written to a file; the console gets ranks through torchrun's tee, except global rank 0,
        # which zrun mirrors byte for byte (launcher/mirror.py) so progress bars redraw in place.
        f"--log-dir={log_dir}",
        "--redirects=3",
        f"--tee={tee_spec(nproc, 0 if node_rank == 0 else None)}",
    ]
    if cfg.module:
        argv.append("--module")
    if cfg.no_python:
        argv.append("--no-python")
    # `--`: torch's parser allows abbreviations, so a script's `--log 1` would otherwise be taken
    # for an ambiguous `--log-dir`/`--logs-specs` and fail the launch; after it, all is the script's.
    argv.extend(["--", cfg.script, *cfg.script_args])
    if cfg.append_local_rank:
        # The agent substitutes ${local_rank} per worker (torch.distributed.elastic.utils.macros).
        argv.append("--local_rank=${local_rank}")

    threads = plan_threads(nproc, cores, base_env)
    env: dict[str, str] = {
        # Console lines say the global rank, which is what error messages and users talk about.
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
    }
    if not threads.from_user:
        env["OMP_NUM_THREADS"] = str(threads.threads)
    # A rank's output reaches this console through a log file (launcher/mirror.py), so the rank cannot
    # see whether the console is a terminal: say it (examples/progress.py draws a bar there, else lines).
    env[CONSOLE_ENV] = base_env.get(CONSOLE_ENV) or ("1" if sys.stderr.isatty() else "0")
    if "PYTHONUNBUFFERED" not in base_env:
        # Rank stdout goes to a tee'd file: block buffering would delay console lines and lose the
        # last ones (the ones a failure report needs) when the rank is killed.
        env["PYTHONUNBUFFERED"] = "1"
    if cfg.master_addr in LOOPBACK and "GLOO_SOCKET_IFNAME" not in base_env and sys.platform == "linux":
        # Keep gloo's per-rank listeners on loopback when the job is local, whatever the hostname
        # resolves to. (torch's TCPStore itself binds all interfaces; the agent CLI cannot change it.)
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if cfg.hosts[node_rank].slots != tuple(range(nproc)):
        # --include host:1,3 picks devices; ranks then see them as 0..n-1 like with DeepSpeed.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in cfg.hosts[node_rank].slots)
    return AgentCommand(argv, env, threads)
