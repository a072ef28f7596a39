"""`zrun [options] script.py [script args...]`: arguments -> LaunchConfig -> run."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from launcher.args import config_from_args
from launcher.errors import LaunchError
from launcher.multinode import launch
from launcher.run import run


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
        return launch(cfg) if cfg.is_controller else run(cfg)
    except LaunchError as e:
        print(f"zrun: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
