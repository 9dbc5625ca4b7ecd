"""Finding JAX's internals: imports and names probed without a warning, the version, what is missing."""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import sys
import threading
import types
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from pallas_guard._vocabulary.errors import PallasGuardWarning

missing: dict[str, str] = {}
"""Internal name -> what the guard cannot do without it. Filled as lookups fail."""


_missing_lock = threading.Lock()


_warned_missing: set[str] = set()


def import_optional(name: str) -> types.ModuleType | None:
    """Import ``name`` or return None; ImportError covers a missing optional dependency (absl).

    A module found absent stays absent for the process: its import is tried (as a probe, under
    :func:`probing`) once, not at every kernel call."""
    module = sys.modules.get(name)  # the common case, on every kernel call: no import machinery
    if module is not None or name in _absent_modules:
        return module
    try:
        with probing():
            return importlib.import_module(name)
    except ImportError:
        _absent_modules.add(name)
        return None


_absent_modules: set[str] = set()


_ABSENT = object()


def first_attribute(candidates: Iterable[tuple[str, str]]) -> Any | None:
    """The first ``module.attribute`` of ``candidates`` that the module itself defines, else None.

    Read from the module's namespace, never through ``getattr``: a name JAX serves from a module
    ``__getattr__`` is one it deprecated (``jax.pallas.pallas_call_p`` from 0.12.1), and asking for
    it warns in the user's process (an error under ``-W error``); the next candidate is the route
    JAX keeps."""
    for module_name, attribute in candidates:
        module = import_optional(module_name)
        if module is not None:
            found = vars(module).get(attribute, _ABSENT)
            if found is not _ABSENT:
                return found
    return None


_probe = threading.local()


_IGNORE_ALL = [("ignore", None, Warning, None, 0)]


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Inside: what JAX warns while the guard looks it over (a deprecated name, an import) is
    dropped, whatever the user's warning filters say (``-W error``, ``filterwarnings = error``), so
    a probe never warns, prints or raises in the user's process; the guard's own warnings
    (:func:`note_missing`) are warned on the way out, under the user's filters.

    The filter list is swapped, not changed through ``warnings`` (``catch_warnings``, ``simplefilter``):
    those bump Python's filter version, which makes every warning already shown once per location
    show again. The swap is process-wide for its instant (as ``catch_warnings`` is before Python
    3.14's context-aware warnings): a warning another thread raises then is dropped too. Probes are
    few and short (the arming, a module's first import), never on a kernel's hot path."""
    if getattr(_probe, "depth", 0):
        _probe.depth += 1
        try:
            yield
        finally:
            _probe.depth -= 1
        return
    saved = warnings.filters
    warnings.filters = list(_IGNORE_ALL)
    _probe.depth, _probe.pending = 1, []
    try:
        yield
    finally:
        warnings.filters = saved
        _probe.depth = 0
    pending, _probe.pending = _probe.pending, []
    for text in pending:
        warnings.warn(text, PallasGuardWarning, stacklevel=3)


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (its metadata; nothing imported), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def jax_version(package: str = "jax") -> str:
    """The running jax's version (or jaxlib's: ``package="jaxlib"``), for messages only."""
    return str(getattr(sys.modules.get(package), "__version__", "unknown"))


def _warn_once(key: str, text: str) -> None:
    with _missing_lock:
        if key in _warned_missing:
            return
        _warned_missing.add(key)
    if getattr(_probe, "depth", 0):  # inside a probe: warned when it ends, under the user's filters
        _probe.pending.append(text)
        return
    warnings.warn(text, PallasGuardWarning, stacklevel=3)


def note_missing(name: str, consequence: str) -> None:
    """Record a missing internal and warn once per name (never an error: the guard degrades)."""
    with _missing_lock:
        missing[name] = consequence
    _warn_once(name, f"pallas_guard: JAX internal {name!r} not found in jax {jax_version()}; {consequence}.")


TESTED_BELOW = (0, 13)
"""The first jax release past the range CI proves (pyproject's upper bound ``jax<0.13``)."""


SUPPORTED = "jax>=0.7.2,<0.13"
"""The range CI proves, as pyproject.toml declares it (a test keeps the two in step)."""


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def jax_release() -> tuple[int, ...]:
    """The running jax's release as numbers, ``(0, 10, 2)``; empty when unknown."""
    return _release_cached(jax_version())


_release_cached = functools.lru_cache(maxsize=4)(_release)


def tested_range_notice() -> str | None:
    """The notice for a jax past the tested range, else None; shown by the pytest header and
    ``doctor``, never warned: it concerns the installation, not a kernel, and a warning while
    pytest configures would stop a ``filterwarnings = error`` session. What the guard does there is
    decided by feature detection, and a missing internal is reported by :func:`note_missing`."""
    version = jax_version()
    release = _release(version)
    if not (release and release >= TESTED_BELOW):
        return None
    tested = ".".join(map(str, TESTED_BELOW))
    return (
        f"jax {version} is newer than the range pallas_guard was tested with (jax < {tested}); it keeps "
        "every layer whose JAX internals it finds, reports any it does not, and refuses with a diagnostic "
        "where it cannot run a kernel interpreted"
    )
