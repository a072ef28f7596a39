"""Fixture: each rank writes its pid to a directory, then sleeps (for signal tests)."""

import os
import sys
import time


def main() -> None:
    pid_dir = sys.argv[1]
    rank = os.environ["RANK"]
    tmp = os.path.join(pid_dir, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(pid_dir, f"rank{rank}.pid"))  # atomic: the test never reads half a pid
    print(f"rank {rank} sleeping pid={os.getpid()}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
