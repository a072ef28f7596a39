"""The environment a node's ranks get from the launching machine (as DeepSpeed's runner exports it).

Remote shells start with a login environment, not the launcher's: the variables that steer the
communication libraries, Python and threading are carried over, plus KEY=VAL lines of `.zrun_env`
(and DeepSpeed's `.deepspeed_env`) found in the home directory or the working directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from launcher.errors import LaunchError

EXPORT_PREFIXES = ("NCCL", "PYTHON", "UCX", "MV2", "GLOO", "TORCH", "OMP")
EXPORT_NAMES = ("CUDA_VISIBLE_DEVICES",)
ENV_FILE_NAMES = (".deepspeed_env", ".zrun_env")  # the later one wins for the same key
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VAL per line; blank lines and `#` comments skipped; the value is taken verbatim."""
    out: dict[str, str] = {}
    with open(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if not sep or not _NAME.fullmatch(key):
                raise LaunchError(
                    f"{path}:{lineno}: bad line {line!r}; hint: each line is KEY=VALUE with KEY a "
                    f"variable name (letters, digits, '_')"
                )
            out[key] = value
    return out


def env_files(dirs: Sequence[str]) -> list[str]:
    seen: list[str] = []
    for d in dirs:
        for name in ENV_FILE_NAMES:
            path = os.path.realpath(os.path.join(d, name))
            if os.path.isfile(path) and path not in seen:
                seen.append(path)
    return seen


def exported_env(environ: Mapping[str, str], dirs: Sequence[str]) -> dict[str, str]:
    """What every node gets: matching variables of `environ`, then the env files in `dirs` order."""
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORT_PREFIXES) or k in EXPORT_NAMES}
    for path in env_files(dirs):
        out.update(read_env_file(path))
    return out
