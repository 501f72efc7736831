"""Errors that end a fusectl run with a one-line message and a documented exit code."""

from __future__ import annotations


class FusectlError(Exception):
    """Bad usage or bad input: reported as one line on stderr, exit code 2."""

    exit_code = 2

    def __init__(self, message: str, *, path: object | None = None) -> None:
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)
