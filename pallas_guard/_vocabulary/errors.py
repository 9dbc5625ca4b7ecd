"""The exceptions and warnings pallas_guard raises; public through ``pallas_guard``."""

from __future__ import annotations

import re
import sys
import warnings


class PallasGuardError(ValueError):
    """A Pallas kernel would lower for the CPU without an interpreter, under policy ``strict``.

    A ``ValueError`` because JAX's own CPU rule raises one, so existing handlers keep working.
    """


class PallasGuardWarning(UserWarning):
    """A Pallas kernel lowered for the CPU is being run interpreted (policy ``warn``)."""


# Shown as `pallas_guard.PallasGuardError` in tracebacks, the name users import and filter by.
for _public in (PallasGuardError, PallasGuardWarning):
    _public.__module__ = "pallas_guard"
del _public

CATEGORIES = {cls.__name__: cls for cls in (PallasGuardWarning,)}


def apply_startup_warning_options() -> None:
    """Honour ``-W``/``PYTHONWARNINGS`` entries that name a pallas_guard category.

    Python resolves those categories before site-packages is importable, prints "Invalid -W
    option ignored" and drops them; ``sys.warnoptions`` keeps the text, so they are added here,
    in Python's own order (a later option wins), when pallas_guard is imported.
    """
    for option in sys.warnoptions:
        parts = [part.strip() for part in option.split(":")]
        if len(parts) < 3 or not parts[2].startswith("pallas_guard.") or len(parts) > 5:
            continue
        action, message, category_name, module, line = (*parts, "", "")[:5]
        category = CATEGORIES.get(category_name.removeprefix("pallas_guard."))
        # As warnings._getaction: "" is "default", "all" is "always", else a prefix of an action.
        actions = ("default", "always", "ignore", "module", "once", "error")
        matched = "always" if action == "all" else next((a for a in actions if a.startswith(action)), None)
        if category is None or matched is None or (line and not line.isdigit()):
            continue  # not one of ours, or invalid: Python already reported it
        warnings.filterwarnings(
            matched,  # type: ignore[arg-type]
            message=re.escape(message),
            category=category,
            module=re.escape(module) + r"\Z" if module else "",
            lineno=int(line) if line else 0,
        )
