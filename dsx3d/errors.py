"""User-facing errors: each names the key, the value, the reason and the fix.

The CLI turns a `UserError` into one message on stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe or a command line."""

    key: str
    value: object
    reason: str
    fix: str
    severity: str = "error"  # "error" stops the run; "warning" is reported and allowed

    def __str__(self) -> str:
        return f"{self.severity}: {self.key} = {self.value!r}: {self.reason}. Fix: {self.fix}"


class UserError(Exception):
    """Bad input from the user; carries every problem found, not only the first."""

    def __init__(self, problems: list[Problem] | Problem):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def single(cls, key: str, value: object, reason: str, fix: str) -> UserError:
        return cls(Problem(key, value, reason, fix))


class RunFailure(Exception):
    """A run stopped for a reason outside its inputs (a full disk, a diverged loss): one clear message, no
    traceback. Ranks exit with code 1. `everywhere`: every rank raises the same one (then rank 0 says it)."""

    def __init__(self, message: str, *, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere
