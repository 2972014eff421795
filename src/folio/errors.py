"""Which failures are the user's to fix: shown as one line, without a traceback.

A bad value, path or checkpoint raises ValueError or OSError (the loader turns
safetensors' own error for a corrupt file into a ValueError naming it); other
Rust extensions raise a bare Exception for a file they cannot parse. Anything
else is a bug and keeps its traceback. Shared by the CLI and the server's
start-up.
"""

from __future__ import annotations


def is_expected_error(err: BaseException) -> bool:
    return isinstance(err, (ValueError, OSError)) or type(err) is Exception
