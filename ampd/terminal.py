"""The CLI's console: rich's, except that output piped to a file or another program is not
cut to 80 columns (rich's width without a terminal), so a table row stays one line a
script can read. ``COLUMNS`` still sets the width where given."""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPED_WIDTH = 240  # wide enough for every table ampd prints


def console() -> Console:
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=PIPED_WIDTH) if piped else Console()
