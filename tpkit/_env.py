"""Every boolean ``TPKIT_*`` switch is parsed here (``env_flag``): a leaf that imports nothing of
tpkit, so the layout and the transports below it both read their switches the same way."""
from __future__ import annotations

import os
from typing import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str, env: Mapping[str, str] | None = None, *, default: bool,
             fix: str = "use 1 or 0") -> bool:
    """The boolean environment variable ``name`` (1/true/yes/on, 0/false/no/off or empty;
    ``default`` when unset), or ValueError naming the value and ``fix``. Every TPKIT_*
    switch is parsed here."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; {fix}")
