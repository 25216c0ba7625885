"""Error types. Every user-facing failure is a SpinError with a one-line message."""


class SpinError(ValueError):
    """Base class: bad input that the user can fix (the CLI exits 2 on it)."""


class SpinConfigError(SpinError):
    """An invalid SpinConfig value or key."""


class TraceError(SpinError):
    """A SPIN trace file that is missing, truncated or inconsistent."""
