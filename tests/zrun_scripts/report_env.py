"""Fixture: each rank writes what it was given (argv, environment, directory) to argv[1]/rank<R>.json.

No torch import and no process group: it starts fast and checks only what the launcher delivered.
"""

import json
import os
import sys

out = sys.argv[1]
rank = os.environ["RANK"]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "ZRUN_TEST_VALUE", "NCCL_TEST_VALUE")
record = {"argv": sys.argv[2:], "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
with open(os.path.join(out, f".rank{rank}.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f".rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
