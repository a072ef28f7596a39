"""The one error type of the launcher."""


class LaunchError(Exception):
    """A fatal, user-facing launcher error; main() prints it prefixed with `zrun:` and exits 1.

    Messages name the host/rank or file involved and end with a hint, so they are actionable alone.
    """
