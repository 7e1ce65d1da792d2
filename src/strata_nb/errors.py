"""The one exception type for user mistakes and bad inputs.

Anything raised as StrataError is shown to the user as one clear line (CLI: exit code 2,
server: HTTP 4xx); anything else is a bug in strata-nb and keeps its traceback.
"""


class StrataError(Exception):
    """A problem with what the user gave us (a path, a file, a flag value, a prompt)."""
