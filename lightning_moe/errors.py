"""Errors about what the user gave (a file, a path, a value), as opposed to failures of the code.

The message of an :class:`InputError` names the file or value at fault and what to do about it,
so `lightning-moe` prints it as one ``error: <message>`` line and exits with code 2 instead of
showing a traceback (from every rank, in a distributed run).
"""

from __future__ import annotations


class InputError(Exception):
    """A file or value given by the user cannot be used; the message says which one and the fix.

    Subclasses also derive from the builtin type that callers would otherwise catch
    (``FileNotFoundError``, ``ValueError``, ...)."""


__all__ = ["InputError"]
