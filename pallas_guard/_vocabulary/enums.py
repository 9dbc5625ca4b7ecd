"""The public enums."""

from __future__ import annotations

import enum


class Policy(enum.StrEnum):
    """What the guard does with a Pallas kernel that would lower for the CPU without ``interpret=``."""

    INTERPRET = "interpret"
    """Run it in the right interpret mode, silently."""
    WARN = "warn"
    """Run it interpreted and emit a :class:`PallasGuardWarning` at the user's line."""
    STRICT = "strict"
    """Raise :class:`PallasGuardError` with a diagnostic."""
    OFF = "off"
    """Do nothing: JAX's own error comes back."""


class Interpreter(enum.StrEnum):
    """Which interpreter runs a kernel on the CPU."""

    AUTO = "auto"
    """Choose per kernel: plain unless the kernel needs TPU or Mosaic-GPU semantics."""
    PLAIN = "plain"
    """JAX's HLO interpreter (``interpret=True``)."""
    TPU = "tpu"
    """TPU interpret mode (``pltpu.InterpretParams``)."""
    GPU = "gpu"
    """The Mosaic-GPU interpreter (``InterpretGPUParams``)."""


for _public in (Policy, Interpreter):
    _public.__module__ = "pallas_guard"
del _public
