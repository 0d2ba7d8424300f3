"""platform.quiet: a C library's stderr and Python's, held aside and given back on request."""

import os
import sys

from ref_impl.platform.quiet import held_stderr


def test_held_stderr_holds_what_python_and_c_write_and_gives_it_back(capfd):
    with held_stderr() as log:
        print("from python", file=sys.stderr)
        os.write(2, b"from C, file descriptor 2\n")
        held = log()
    print("after", file=sys.stderr)
    os.write(2, b"after, from C\n")
    assert "from python" in held and "from C, file descriptor 2" in held
    assert capfd.readouterr().err == "after\nafter, from C\n"   # nothing held leaked; stderr is back
