"""The one exception type for user mistakes and bad inputs.

Anything raised as StrataError is shown to the user as one clear line (CLI: exit code 2,
server: HTTP 4xx); anything else is a bug in strata-nb and keeps its traceback.
"""


class StrataError(Exception):
    """A problem with what the user gave us (a path, a file, a flag value, a prompt)."""


class SettingError(StrataError):
    """A setting with a bad value, named the way the caller gave it: the Python API shows the
    parameter (`max_tokens must be at least 1`), the CLI the flag (`--max-tokens must ...`).
    The message is written once, after the name."""

    def __init__(self, setting: str, problem: str):
        self.setting, self.problem = setting, problem  # "max_tokens", "must be at least 1, got 0"
        super().__init__(f"{setting} {problem}")

    @property
    def flag(self) -> str:
        """The CLI flag of the setting: the CLI's options map onto the settings one to one."""
        return "--" + self.setting.replace("_", "-")
