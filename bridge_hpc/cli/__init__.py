"""The command-line tools (``bridge-*``), and what several of them share."""

from __future__ import annotations

import os
import sys


def quiet_stdout() -> None:
    """After a BrokenPipeError on stdout (the reader of ``bridge-report | head`` went away): point stdout
    at /dev/null, so that the interpreter's last flush at exit fails on nothing and prints no traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
