"""A finding made while a compiled computation runs reaches the caller as ``PallasGuardError``.

Checks that can only judge at run time (bounds, races) call back to the host when they fail, and
JAX wraps whatever a host callback raises into its own runtime error (``INTERNAL: CpuCallback error
calling callback: Traceback ...``): the type a user catches would depend on whether the call was
eager or jitted. So the callback records the finding here, under a token, and raises only the
token; the guard's wrapper around JAX's executable call, the Python frame every computation with
host callbacks runs through (eager calls and ``jax.jit`` alike), raises the recorded finding in
place of JAX's error, after the call and outside the callback, as checkify raises what it carried
out of a computation. A finding that names its call (the bounds and races checks') is written
there: for an eager call, the call that faulted (JAX runs the executable compiled at the first
call again at later ones, from other lines); under a trace, where the traced code called the kernel.

JAX's C++ dispatch of a jitted computation, which skips that wrapper, is not used for a CPU
computation with host callbacks compiled while such a check is in force: its finding would reach
the caller of a later call as JAX's runtime error.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import itertools
import logging
import re
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

from pallas_guard._deciding.diagnostics import CallSite
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.patch import wrap

_TOKEN = "pallas_guard finding #"
_TOKEN_PATTERN = re.compile(re.escape(_TOKEN) + r"(\d+)")
_KEPT = 64  # findings whose computation never returned to a wrapped call (another dispatch) age out

_lock = threading.Lock()
_numbers = itertools.count(1)


class AtTheCall(NamedTuple):
    """A finding written for the call that made it: its text for a call site (``build``), and
    ``report``, which records it as its check's finding and returns it."""

    build: Callable[[CallSite], PallasGuardError]
    report: Callable[[PallasGuardError, CallSite], PallasGuardError]
    lowered_for: CallSite
    """The call the kernel was lowered for: the site where none is on the stack."""

    def at(self, call_site: CallSite | None) -> PallasGuardError:
        site = call_site if call_site is not None and call_site.user else self.lowered_for
        return self.report(self.build(site), site)


_pending: collections.OrderedDict[int, PallasGuardError | AtTheCall] = collections.OrderedDict()


class RecordedFinding(Exception):
    """What a callback raises for a recorded finding: the token, then the finding's own text (read
    as it is where no wrapper translates it)."""


_eager_call: contextvars.ContextVar[CallSite | None] = contextvars.ContextVar("pallas_guard_call", default=None)


@contextlib.contextmanager
def eager_call(call_site: CallSite) -> Iterator[None]:
    """Inside: the kernel called eagerly at ``call_site`` runs, and a finding it makes names it."""
    token = _eager_call.set(call_site)
    try:
        yield
    finally:
        _eager_call.reset(token)


def record(finding: PallasGuardError | AtTheCall) -> NoReturn:
    """Keep ``finding`` for the caller of the computation, and stop the computation."""
    number = next(_numbers)
    with _lock:
        _pending[number] = finding
        while len(_pending) > _KEPT:
            _pending.popitem(last=False)
    text = finding.build(finding.lowered_for) if isinstance(finding, AtTheCall) else finding
    raise RecordedFinding(f"{_TOKEN}{number}: {text}")


def recorded_in(error: BaseException, call_site: CallSite | None = None) -> PallasGuardError | None:
    """The finding ``error`` carries (JAX's runtime error around a recorded finding), taken out of
    the record, written for ``call_site`` where it names its call; None when it carries none."""
    if isinstance(error, PallasGuardError):
        return error
    match = _TOKEN_PATTERN.search(str(error))
    if match is None:
        return None
    with _lock:
        found = _pending.pop(int(match.group(1)), None)
    return found.at(call_site) if isinstance(found, AtTheCall) else found


# --- work a check does after a computation ran -------------------------------------------------------
# A check that needs JAX to judge what a computation computed (agree runs other interpreters on the
# call's operands) cannot run it inside the computation's host callback: a computation dispatched
# from an XLA thread that is waiting for the callback can deadlock. The callback hands the work over
# here; the wrapper around JAX's executable call does it once the computation is done, outside XLA.

_awaited: set[int] = set()
"""Gates traced into computations whose first run has not come yet: while one is, a computation
dispatched from Python is waited for, so its gate's work is done before the call returns."""
_handed_over: list[Callable[[], None]] = []


def await_gate() -> int:
    """A number for a gate traced into a computation now; ``hand_over`` takes it when it runs."""
    number = next(_numbers)
    with _lock:
        _awaited.add(number)
    return number


def hand_over(gate: int, work: Callable[[], None] | None) -> None:
    """From the gate's host callback: ``work`` (which may raise the finding) is done after the
    computation returns, in the call's own thread; None: the gate has nothing to do."""
    with _lock:
        _awaited.discard(gate)
        if work is not None:
            _handed_over.append(work)


def _after_the_run(out: Any) -> None:
    import jax

    ready: Any = jax.block_until_ready
    ready(out)
    with _lock:
        works = list(_handed_over)
        _handed_over.clear()
    for work in works:
        work()


# --- waits a check leaves to the computation's first run ---------------------------------------------
# A check that started work beside a kernel's trace (the compile check: libtpu's or XLA's compile)
# would wait for it as the trace ends. Under a jit call, which lowers, compiles and runs the program
# before it returns, it can wait just before the program runs instead: its compile then overlaps the
# program's lowering and XLA's compile, and a refusal still stops the call before anything runs.

_waits: dict[int, list[tuple[types.FrameType, Callable[[], None]]]] = {}
"""Per thread: the waits left to a program's first run, each with the frame of the jit call whose
program it is (held while it waits)."""


def wait_before_the_run(call: types.FrameType, wait: Callable[[], None]) -> bool:
    """Leave ``wait`` (which may raise the finding) to the first run of the program of the jit call
    running in frame ``call``, which the call makes before it returns (a computation made while the
    program is traced, lowered or compiled is not its run); False where the guard's wrapper around
    JAX's executable call is not in place (the caller waits now)."""
    cls = jax_tracing.executable_class()
    if cls is None or not _is_ours(vars(cls).get("__call__")):
        return False
    with _lock:
        _waits.setdefault(threading.get_ident(), []).append((call, wait))
    return True


def _wait_now() -> None:
    """This thread's waits for the jit call running now, all of them, before its program runs; the
    first failure is raised once every wait is done (each records its note). Waits of a call that
    ended without running its program (it failed to lower or compile) are dropped: nothing of
    it ran."""
    with _lock:
        waits = _waits.pop(threading.get_ident(), None) or []
    running = jax_tracing.on_the_stack([call for call, _ in waits])
    failure: BaseException | None = None
    for (_, wait), live in zip(waits, running, strict=True):
        if not live:
            continue
        try:
            wait()
        except BaseException as error:  # raised below, after the others recorded theirs
            failure = failure or error
    if isinstance(failure, PallasGuardError):
        raise failure.with_traceback(None) from None
    if failure is not None:
        raise failure


def hook(hooks: list[Any], *, checking_at_run_time: Callable[[], bool]) -> None:
    """Wrap JAX's executable call once and quiet JAX's log of a recorded finding; the entries added
    to ``hooks`` put both back. While ``checking_at_run_time()`` (a check in force finds while a
    computation runs), a CPU computation with host callbacks compiled then is dispatched from Python."""
    wrap(jax_tracing.executable_class(), "__call__", _raising_findings, hooks, is_ours=_is_ours)
    dispatch = jax_tracing.fast_dispatch_module()
    through = functools.partial(_through_the_wrapper, checking_at_run_time=checking_at_run_time)
    wrap(dispatch, jax_tracing.FAST_DISPATCH_DATA, through, hooks, is_ours=_is_ours)
    if not any(isinstance(f, _QuietFindings) for f in logging.getLogger(_CALLBACK_LOGGERS[0]).filters):
        hooks.append(_QuietFindings())
    hooks.append(_ForgetGates())


class _ForgetGates:
    """On uninstall: gates traced but never run, and work or waits never done, are dropped (no later
    call waits for them, none does a check's work for a guard that is gone)."""

    @staticmethod
    def restore() -> None:
        with _lock:
            _awaited.clear()
            _handed_over.clear()
            _waits.clear()


_CALLBACK_LOGGERS = ("jax._src.callback", "jax._src.debugging")
"""Where JAX logs a host callback's exception: io/pure callbacks, and ``jax.debug.callback``."""
_handled_by_a_check = [0]
"""How many checks are running an interpreter beside the chosen one: a failure of its host
callbacks is theirs to report (a finding or a note), and JAX's log of it would be noise."""


@contextlib.contextmanager
def callback_failures_handled() -> Iterator[None]:
    """Inside: a check runs an interpreter whose failure it reports itself; JAX's log of a host
    callback failing is dropped meanwhile (the guard's own filter, installed with the guard)."""
    with _lock:
        _handled_by_a_check[0] += 1
    try:
        yield
    finally:
        with _lock:
            _handled_by_a_check[0] -= 1


class _QuietFindings(logging.Filter):
    """JAX logs every exception a host callback raises, traceback and all, then raises it: a
    finding reaches the caller in that error; logged as well, it would be said twice."""

    def __init__(self) -> None:
        super().__init__()
        for name in _CALLBACK_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        raised = record.exc_info[1] if record.exc_info else None
        return not isinstance(raised, RecordedFinding) and not _handled_by_a_check[0]

    def restore(self) -> None:
        for name in _CALLBACK_LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _is_ours(function: Any) -> bool:
    return getattr(function, "pallas_guard_findings", False) is True


def _raising_findings(call: Callable[..., Any]) -> Callable[..., Any]:
    def pallas_guard_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _waits and jax_tracing.running_a_program():
            try:
                _wait_now()
            except PallasGuardError:
                # JAX keeps the call's trace and executable, and would run them at the next call of
                # the same shapes without a trace the check sees: dropped, that call traces again and
                # is refused there.
                jax_tracing.forget_programs()
                raise
        try:
            out = call(self, *args, **kwargs)
        except Exception as error:
            found = recorded_in(error, _eager_call.get())
            if found is None:
                raise
            # JAX's error says nothing the finding does not (its text is the callback's traceback).
            raise found.with_traceback(None) from None
        # Only a computation with host callbacks can hold a gate: any other is never waited for.
        if (_awaited or _handed_over) and getattr(self, "has_host_callbacks", True):
            _after_the_run(out)
        return out

    pallas_guard_execute.pallas_guard_findings = True  # type: ignore[attr-defined]
    return pallas_guard_execute


def _through_the_wrapper(
    fast_path_data: Callable[..., Any], *, checking_at_run_time: Callable[[], bool]
) -> Callable[..., Any]:
    # Asked once per computation, at its first call: the settings then are those it was compiled
    # under (a computation compiled without a check has no finding to raise).
    def pallas_guard_fast_path_data(executable: Any, *args: Any, **kwargs: Any) -> Any:
        call = getattr(executable, "unsafe_call", None)
        if getattr(call, "has_host_callbacks", False) and _on_cpu(call) and checking_at_run_time():
            return None  # dispatched from Python, through the wrapper that raises a finding
        return fast_path_data(executable, *args, **kwargs)

    pallas_guard_fast_path_data.pallas_guard_findings = True  # type: ignore[attr-defined]
    return pallas_guard_fast_path_data


def _on_cpu(call: Any) -> bool:
    devices = getattr(call, "_local_devices", None) or ()
    return bool(devices) and all(getattr(device, "platform", None) == "cpu" for device in devices)
