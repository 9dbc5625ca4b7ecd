"""Activation at interpreter start-up: the ``.pth`` line and a ``sitecustomize`` that imports us.

The wheel ships ``pallas_guard_autoload.pth`` (:data:`PTH_NAME`) at the top of site-packages. Its
one constant line imports ``pallas_guard`` only when ``PALLAS_GUARD_POLICY`` is set and not blank
(the coverage.py ``COVERAGE_PROCESS_START`` pattern: no module name is ever read from the
environment), then calls :func:`after_pth`. ``import pallas_guard`` calls
:func:`install_at_import`, which calls the same ``install()`` as every other surface.

Start-up must never break: while ``site`` is processing a ``.pth`` file or importing
``sitecustomize``/``usercustomize``, a bad setting prints one line to stderr and leaves the guard
off, instead of raising out of site processing (which would print a traceback and skip the rest of
the user's ``sitecustomize``). The ``pallas-guard`` CLI also imports the package without raising
(``doctor`` reports the bad value, ``run`` refuses it). Anywhere else, ``import pallas_guard``
raises as documented.
"""

from __future__ import annotations

import os
import sys

from ._install import install

TYPE_CHECKING = False  # not `from typing import`: this module runs at interpreter start-up
if TYPE_CHECKING:
    import types

PTH_NAME = "pallas_guard_autoload.pth"
"""The file name the wheel installs at the top of site-packages."""

# The functions of the stdlib ``site`` module that run .pth lines and the customize modules.
_SITE_FUNCTIONS = frozenset({"addpackage", "execsitecustomize", "execusercustomize"})


def during_site_startup() -> bool:
    """True while ``site`` is processing a ``.pth`` line or importing ``sitecustomize``."""
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - a handful of frames, no source reads
    while frame is not None:
        if frame.f_code.co_name in _SITE_FUNCTIONS and frame.f_globals.get("__name__") == "site":
            return True
        frame = frame.f_back
    return False


_failed_at_startup = False
imported_at_startup = False
"""Whether ``pallas_guard`` was imported by site processing (the ``.pth`` line or ``sitecustomize``)."""
_REPORTED = "_pallas_guard_startup_error"


def after_pth() -> None:
    """Called by the ``.pth`` line once ``import pallas_guard`` has returned.

    After a bad setting, drop our modules, so that a later explicit ``import pallas_guard`` runs
    again and raises the error itself. Nothing was registered: ``install()`` validates first. (Not
    possible from inside the package's own import, which importlib is still completing.)
    """
    if _failed_at_startup:
        for name in [name for name in sys.modules if name == "pallas_guard" or name.startswith("pallas_guard.")]:
            del sys.modules[name]


_CLI_MODULES = frozenset({"pallas_guard", "pallas_guard.__main__"})


def cli_startup() -> bool:
    """True in the ``pallas-guard`` CLI process, which reports a bad setting itself (``doctor``)."""
    script = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    if script in {"pallas-guard", "pallas-guard-script"}:
        return True
    # `python [options] -m pallas_guard ...`: sys.argv[0] is still "-m" while runpy imports us.
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    index = 0
    while index < len(argv):
        argument = argv[index]
        if argument == "-m":
            return index + 1 < len(argv) and argv[index + 1] in _CLI_MODULES
        if argument.startswith("-m"):
            return argument[2:] in _CLI_MODULES
        if argument == "-c" or not argument.startswith("-"):
            return False  # the interpreter's own options end here
        index += 2 if argument in {"-X", "-W"} else 1
    return False


def install_at_import() -> None:
    """What ``import pallas_guard`` does: ``install()`` from the environment; never raises at start-up."""
    global _failed_at_startup, imported_at_startup  # noqa: PLW0603 - read once the import has returned
    at_startup = imported_at_startup = during_site_startup()
    if not at_startup and not cli_startup():
        install()
        return
    try:
        install()
    except Exception as error:
        if at_startup:
            _failed_at_startup = True
            line = "pallas_guard: " + " ".join(str(error).split()) + "; the guard is off in this process.\n"
            # site runs a venv's .pth files twice (CPython 3.11, 3.12), and after_pth() has dropped
            # this module in between: the mark that the line was printed must outlive it.
            if getattr(sys, _REPORTED, None) != line:
                setattr(sys, _REPORTED, line)
                sys.stderr.write(line)


def installed_pth_files() -> list[str]:
    """The ``.pth`` autoload files the running interpreter processes at start-up (site dirs only)."""
    import site

    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    found = []
    for directory in dict.fromkeys(directories):
        path = os.path.join(directory, PTH_NAME)
        if os.path.isfile(path):
            found.append(path)
    return found
