"""Fixture: prints its argv and rank environment; imports no torch so that it starts fast."""

import os
import sys

print(
    f"ARGV rank={os.environ.get('RANK')} local_rank={os.environ.get('LOCAL_RANK')} "
    f"world={os.environ.get('WORLD_SIZE')} argv={sys.argv[1:]!r}",
    flush=True,
)
