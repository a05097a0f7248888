"""Folders for the stores and run folders of generated examples, all under one per-process folder that is
removed when the process exits (a suite run makes thousands: before, each stayed in /tmp).
DRMAS_PROP_KEEP=1 keeps them, to look at a failing example's store."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_ROOT = Path(tempfile.mkdtemp(prefix="drmas-prop-"))
if not os.environ.get("DRMAS_PROP_KEEP"):
    atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def fresh_dir(prefix: str = "example-") -> Path:
    """A new empty folder under this process's scratch folder."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_ROOT))
