"""``pallas-guard`` / ``python -m pallas_guard``: the command line (see :mod:`pallas_guard._surfaces.cli`)."""

from __future__ import annotations

import sys

from pallas_guard._surfaces.cli import main

__all__ = ("main",)

if __name__ == "__main__":
    sys.exit(main())
