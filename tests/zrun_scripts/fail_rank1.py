"""Fixture: rank 1 raises while rank 0 blocks in a collective rank 1 never joins."""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    # A long timeout so that only the launcher can end rank 0's wait, never gloo itself.
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    if rank == 1:
        print("rank 1 about to fail", flush=True)
        stamp = os.environ.get("ZRUN_TEST_FAIL_STAMP")
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        raise RuntimeError("boom from rank 1")
    if os.environ.get("ZRUN_TEST_RANK0_STUCK"):
        # Like a rank whose SIGTERM handler never runs because it is blocked in C++: only SIGKILL works.
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("rank 0 entering all_reduce", flush=True)
    try:
        dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone
    except RuntimeError:
        if os.environ.get("ZRUN_TEST_RANK0_STUCK"):
            time.sleep(600)  # gloo noticed the dead peer; stay stuck anyway
        raise
    print("rank 0 should never get here", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
