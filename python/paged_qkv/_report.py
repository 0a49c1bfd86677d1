"""`Report`: the verdict of `check` (and the base of `check_op`'s `OpReport`)."""

from __future__ import annotations


class Report:
    """The verdict of :func:`check`: the same report as ``paged-qkv check``."""

    def __init__(self, passed: bool, text: str):
        self.passed = passed
        self.text = text

    def assert_ok(self) -> None:
        """Raises ``AssertionError`` with the report as its message unless the check passed."""
        if not self.passed:
            raise AssertionError(self.text)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Report(passed={self.passed})"
