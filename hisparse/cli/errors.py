"""The error a command raises for a problem it finds after its flags parsed."""

from __future__ import annotations


class CommandError(Exception):
    """A problem found while running a command: one line on stderr, prefixed with the
    command's name, and exit status ``code`` (2 for a bad flag value, as argparse does)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
