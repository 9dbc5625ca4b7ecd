"""The checks: one protocol the engine calls, one module per check, found by name.

A check says what it needs before a kernel runs (``before``: lower or compile the kernel for its
target, run it in every interpreter), which failure of a run is its finding (``finding``), and what
it inspects after the run (``after``: the interpreter's race state). The interpreter a check needs
is the interpreter choice's business (``interpreters.candidates``). A check made inside the plain
interpretation (``in_plain``) prepares the kernel's lowering there and names its findings
(``arm_plain``, ``plain_finding``; ``checked_plain`` lowers them). The engine, the front door and
the lowering net name no check: they ask :func:`in_force` for the checks set, each a ``CHECK`` in
the module the settings table names (``pallas_guard_autoload.CHECKS``), imported when first in
force. Adding a check means its module and its line in that table, nothing else.

Every finding of every check goes through :func:`found`: recorded as a decision (action
``found``, with the check's name) and returned as the ``PallasGuardError`` the caller raises; a
finding made while a computation runs is carried out of it by ``findings``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard_autoload import CHECKS

if TYPE_CHECKING:
    from pallas_guard._checks.checked_plain import Active, PlainLowering
    from pallas_guard._deciding.diagnostics import CallSite, KernelInfo
    from pallas_guard._guard.engine import Run


class Check:
    """One check; the defaults do nothing, so a check implements only the steps it has."""

    name: ClassVar[str]
    order: ClassVar[int]
    """Where the engine calls it among the checks in force, lowest first: a kernel its target
    refuses is never run, so the checks that lower (0) or compile (1) it come before those that
    run it."""
    at_front_door: ClassVar[bool] = False
    """Whether the front door must act for it under any trace (it runs before the kernel, or needs
    an interpreter of its own): the plain interpreter alone would be left to the lowering net."""

    def before(self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prepared | None:
        """Before the kernel runs, once per kernel identity and shapes (the engine keeps what it
        returns); raise a finding where the kernel is refused."""
        return None

    def after(self, run: Run, out: Any, interpreter: str) -> None:
        """After the kernel ran in ``interpreter`` (``out``: its outputs, tracers under a trace)."""

    def finding(self, run: Run, error: BaseException) -> PallasGuardError | None:
        """The finding a failed run carries (the kernel's fault, which no other interpreter may
        hide), or None."""
        return None

    in_plain: ClassVar[bool] = False
    """Made inside the plain interpretation, which the lowering net lowers with it
    (``checked_plain``), at the plain interpreter's speed."""

    def arm_plain(self, lowering: PlainLowering) -> Active | None:
        """Before the checked plain interpreter is built for a kernel: prepare ``lowering`` (wrap
        JAX's rules through its ``hooks``, replace its ``params``); return what to enter while the
        interpreter is traced, or None where the check has nothing to check in this kernel."""
        return None

    def plain_finding(
        self, message: str, lowering: PlainLowering, source: str, call_site: CallSite
    ) -> PallasGuardError | None:
        """The finding a failed check of the checked plain interpretation is, for the
        call at ``call_site``, where it is this check's (``message``: the check's text, its fields
        filled in), else None."""
        return None


class Prepared:
    """What a check's ``before`` settled: a note for the decision, the memory the kernel takes
    of each TPU generation, and, where it ran the kernel to check it, the interpreter whose outputs
    are the call's result (eager calls only). ``pending``: the check's work goes on beside the run
    (a compile in a thread); the engine calls it after the run for what the check settles, which
    may raise the check's finding instead of the run's result."""

    __slots__ = ("memory", "note", "outputs", "pending", "settles")

    def __init__(
        self,
        note: str | None = None,
        *,
        memory: tuple[_record.MemoryUse, ...] = (),
        outputs: Any = None,
        settles: bool = True,
        pending: Callable[[], Prepared] | None = None,
    ) -> None:
        self.note, self.memory, self.outputs, self.settles = note, memory, outputs, settles
        self.pending = pending


def in_force(names: Iterable[str]) -> tuple[Check, ...]:
    """The checks named, in the engine's order."""
    named = frozenset(names)
    return tuple(sorted((check_named(name) for name in CHECKS if name in named), key=lambda check: check.order))


@functools.cache
def check_named(name: str) -> Check:
    """The ``CHECK`` of the module the settings table names for ``name``."""
    check: Check = importlib.import_module(CHECKS[name]).CHECK
    return check


def at_front_door(names: Iterable[str]) -> bool:
    """Whether a check among ``names`` acts at the call (the front door must act for it)."""
    return any(check.at_front_door for check in in_force(names))


def unchecked(check: str, why: str, *, kernel: KernelInfo, call_site: CallSite, note: str | None = None) -> str:
    """A check asked for that cannot run on this kernel (``why``): the note its decision carries
    (``note``, else ``<check>: not checked: <why>``); under ``require_checks``, raised instead as the
    ``PallasGuardError`` its call fails with, so a green run never hides a check that did not run.

    Only for a check that applies to the kernel and could not run; a check with nothing to say about
    a kernel (the TPU's compiler on a Triton kernel) is a plain note."""
    from pallas_guard._vocabulary import settings as _settings
    from pallas_guard_autoload import printable

    if not _settings.current("require_checks").value:
        return note or f"{check}: not checked: {why}"
    where = f", called at {call_site.user}" if call_site.user else ""
    error = PallasGuardError(
        f"pallas_guard: the {check} check cannot run on Pallas kernel {printable(kernel.name)} (built with "
        f"{kernel.entry_point}{printable(where)}): {printable(why)}.\nA check that was asked for "
        f"({_settings.stated('checks')}) and could not run fails the call because require_checks is on "
        f"({_settings.stated('require_checks')}). To fix: remove the cause above, or leave {check} out of the "
        "checks for this kernel."
    )
    raise found(check, error, kernel=kernel, call_site=call_site, why=f"the {check} check could not run")


def found(
    check: str,
    error: PallasGuardError,
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    interpreter: str | None = None,
    why: str | None = None,
    memory: tuple[_record.MemoryUse, ...] = (),
) -> PallasGuardError:
    """A finding of ``check``: recorded as a decision, returned for the caller to raise."""
    from pallas_guard._vocabulary import settings as _settings

    policy = _settings.current_policy()
    _record.note(
        kernel,
        called_at=call_site,
        platforms=("cpu",),  # a finding is made where the guard interprets: on the CPU
        policy=policy.value,
        action="found",
        interpreter=interpreter,
        reason=str(error).splitlines()[0],
        layer="front door",
        policy_source=policy.source,
        check=check,
        why=why or f"found by the {check} check",
        memory=memory,
    )
    return error
