"""kvwarm's own home directory: ``$KVWARM_HOME``, else ``~/.cache/kvwarm``.

What kvwarm keeps for itself on a machine lives under it: the built-in models
(``models/``) and the cached model fingerprints (``fingerprints/``). Nothing here is
needed for correctness; deleting it costs only recomputation.
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "KVWARM_HOME"


def kvwarm_home() -> Path:
    """The directory named by ``$KVWARM_HOME``, else ``~/.cache/kvwarm`` (not created here)."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "kvwarm").expanduser()
