"""Fixture: rank 0 draws a carriage-return progress bar on stderr, as tqdm does; no torch import."""

import os
import sys

rank = os.environ.get("RANK")
if rank == "0":
    for i in range(3):
        sys.stderr.write(f"\rBAR {i}/3")
        sys.stderr.flush()
    sys.stderr.write("\n")
print(f"DONE rank={rank}", flush=True)
