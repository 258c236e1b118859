"""Where kvlm keeps what it fetches and builds: models, native kernels, compiled graphs."""
from __future__ import annotations

import os
from pathlib import Path


def kvlm_home() -> Path:
    """Root of kvlm's cache: $KVLM_HOME, or ~/.cache/kvlm."""
    return Path(os.environ.get("KVLM_HOME") or "~/.cache/kvlm").expanduser()
