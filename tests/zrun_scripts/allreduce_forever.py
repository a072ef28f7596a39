"""Fixture: each rank writes its pid to argv[1]/rank<R>.pid, then all-reduces in a loop (for kill tests).

A rank killed mid-loop leaves its peers blocked in, or failing out of, a collective: the launcher
must still stop every rank on every host.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    pid_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # only the launcher may end it
    rank = dist.get_rank()
    tmp = os.path.join(pid_dir, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(pid_dir, f"rank{rank}.pid"))
    t = torch.ones(1024)
    while True:
        dist.all_reduce(t)
        t.fill_(1.0)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
