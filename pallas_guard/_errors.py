"""The exceptions and warnings pallas_guard raises; public through ``pallas_guard``."""

from __future__ import annotations


class PallasGuardError(ValueError):
    """A Pallas kernel would lower for the CPU without an interpreter, under policy ``strict``.

    A ``ValueError`` because JAX's own CPU rule raises one, so existing handlers keep working.
    """


class PallasGuardWarning(UserWarning):
    """A Pallas kernel lowered for the CPU is being run interpreted (policy ``warn``)."""


class PallasGuardConfigError(ValueError):
    """A setting (environment variable or API argument) has a value pallas_guard does not accept."""


# Shown as `pallas_guard.PallasGuardError` in tracebacks, the name users import and filter by.
for _public in (PallasGuardError, PallasGuardWarning, PallasGuardConfigError):
    _public.__module__ = "pallas_guard"
del _public
