"""A C library's chatter held aside: llama.cpp writes its log and warnings to the process's stderr, through
llama-cpp-python's callback (Python's sys.stderr) or straight from C (file descriptor 2), past any Python
logger. A page that calls it must show none of it; a caller that fails wants it, to say why.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def held_stderr() -> Iterator[Callable[[], str]]:
    """Everything written to stderr inside the block, by Python or by C, held aside; the block gets a
    function that returns what was held so far."""
    with tempfile.TemporaryFile() as held, contextlib.redirect_stderr(io.StringIO()) as said:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)

        def text() -> str:
            held.seek(0)
            return said.getvalue() + held.read().decode(errors="replace")
        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
