"""`python -m engine.ops.build`: compile the C++ extension ahead of time (e.g. right after install), into
the same cache the first training run would use; exits non-zero with the reason when it cannot."""

from __future__ import annotations

import os
import sys

from engine.ops import builder


def main() -> int:
    os.environ.setdefault(builder.ENV_MODE, "require")
    try:
        status = builder.status()
    except RuntimeError as error:
        print(f"engine.ops.build: {error}", file=sys.stderr)
        return 1
    print(f"engine.ops.build: extension {status.state} ({status.simd}) in {status.cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
