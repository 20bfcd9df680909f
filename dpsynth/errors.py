"""Exceptions that the CLI turns into a one-line ``error: ...`` and a non-zero exit."""


class DPSynthError(Exception):
    """Bad input or an impossible request; the message is shown to the user as one line."""


class ConfigError(DPSynthError):
    """An unknown key, a bad value or an unknown method in a run configuration."""


class DataError(DPSynthError):
    """A dataset that is missing, unreadable or malformed."""


class PrivacyError(DPSynthError):
    """A privacy parameter outside its valid range."""


class BudgetExceededError(PrivacyError):
    """A mechanism would push the composed privacy loss past the run's fixed budget."""
