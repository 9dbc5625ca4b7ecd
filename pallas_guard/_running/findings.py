"""A finding made while a compiled computation runs reaches the caller as ``PallasGuardError``.

Checks that can only judge at run time (bounds, races) call back to the host when they fail, and
JAX wraps whatever a host callback raises into its own runtime error (``INTERNAL: CpuCallback error
calling callback: Traceback ...``): the type a user catches would depend on whether the call was
eager or jitted. So the callback records the finding here, under a token, and raises only the
token; the guard's wrapper around JAX's executable call, the Python frame every computation with
host callbacks runs through (eager calls and ``jax.jit`` alike), raises the recorded finding in
place of JAX's error, after the call and outside the callback, as checkify raises what it carried
out of a computation.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.patch import wrap

_TOKEN = "pallas_guard finding #"
_TOKEN_PATTERN = re.compile(re.escape(_TOKEN) + r"(\d+)")
_KEPT = 64  # findings whose computation never returned to a wrapped call (another dispatch) age out

_lock = threading.Lock()
_numbers = itertools.count(1)
_pending: collections.OrderedDict[int, PallasGuardError] = collections.OrderedDict()


class RecordedFinding(Exception):
    """What a callback raises for a recorded finding: the token, then the finding's own text (read
    as it is where no wrapper translates it)."""


def record(finding: PallasGuardError) -> NoReturn:
    """Keep ``finding`` for the caller of the computation, and stop the computation."""
    number = next(_numbers)
    with _lock:
        _pending[number] = finding
        while len(_pending) > _KEPT:
            _pending.popitem(last=False)
    raise RecordedFinding(f"{_TOKEN}{number}: {finding}")


def recorded_in(error: BaseException) -> PallasGuardError | None:
    """The finding ``error`` carries (JAX's runtime error around a recorded finding), taken out of
    the record; None when it carries none."""
    if isinstance(error, PallasGuardError):
        return error
    match = _TOKEN_PATTERN.search(str(error))
    if match is None:
        return None
    with _lock:
        return _pending.pop(int(match.group(1)), None)


def hook(hooks: list[Any]) -> None:
    """Wrap JAX's executable call once and quiet JAX's log of a recorded finding; the entries added
    to ``hooks`` put both back."""
    wrap(jax_tracing.executable_class(), "__call__", _raising_findings, hooks, is_ours=_is_ours)
    if not any(isinstance(f, _QuietFindings) for f in logging.getLogger(_CALLBACK_LOGGER).filters):
        hooks.append(_QuietFindings())


_CALLBACK_LOGGER = "jax._src.callback"


class _QuietFindings(logging.Filter):
    """JAX logs every exception a host callback raises, traceback and all, then raises it: a
    finding reaches the caller in that error; logged as well, it would be said twice."""

    def __init__(self) -> None:
        super().__init__()
        logging.getLogger(_CALLBACK_LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        raised = record.exc_info[1] if record.exc_info else None
        return not isinstance(raised, RecordedFinding)

    def restore(self) -> None:
        logging.getLogger(_CALLBACK_LOGGER).removeFilter(self)


def _is_ours(function: Any) -> bool:
    return getattr(function, "pallas_guard_findings", False) is True


def _raising_findings(call: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        except Exception as error:
            found = recorded_in(error)
            if found is None:
                raise
            # JAX's error says nothing the finding does not (its text is the callback's traceback).
            raise found.with_traceback(None) from None

    pallas_guard_execute.pallas_guard_findings = True  # type: ignore[attr-defined]
    return pallas_guard_execute
