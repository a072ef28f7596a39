"""The one error type for configuration problems."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config (or config-derived argument) a person must fix.

    The message names the problem, where it is (key path, file:line:column) and the fix. Several
    problems found in one pass are joined into one ConfigError so a user fixes them in one run.
    """

    def __init__(self, problems: str | list[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = [f"{len(self.problems)} problems in the config:"]
            lines += [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
            message = "\n".join(lines)
        super().__init__(message)
