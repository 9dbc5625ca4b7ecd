"""What the two layers share, kept on the installation object both receive (no module globals).

The front door and the lowering net meet one kernel at different times: the front door when the
kernel is called (traced), the net when it is lowered for the CPU. What the front door did on the
kernel's behalf, the net must know: which ``interpret=`` values it injected (already recorded), that
it is verifying a candidate (the net stays out), what it verified before leaving a kernel to the
net's plain interpreter (so the net's record says it), and the choices it settled, by kernel
identity. Both layers key kernels with :func:`kernel_key`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # at run time only their attributes are read: importing the guard stays light
    from pallas_guard._deciding.diagnostics import CallSite, KernelInfo
    from pallas_guard._vocabulary.entry_points import EntryPoint
    from pallas_guard._vocabulary.record import MemoryUse

Settled = tuple[str, tuple[Any, ...]]
"""A settled choice: an interpreter and what was tried; or a check and what it said (its note and
memory figures)."""


class Left(NamedTuple):
    """What the front door verified of a kernel it left to the net's plain interpreter."""

    tried: tuple[str, ...]
    notes: tuple[str, ...]
    memory: tuple[MemoryUse, ...]


_MAX_ENTRIES = 4096  # per store: one entry per kernel definition or identity, bounded all the same


def kernel_key(kernel: KernelInfo) -> tuple[str, str | None]:
    """How both layers name one kernel definition: the front door from the body it was given, the
    net from the traced jaxpr's source info; both give the body's name and ``file:line``."""
    return kernel.entry_point, kernel.defined_at


class Ledger:
    """Injected values, the verification flag, verified and settled choices."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # By identity: InterpretParams are dataclasses that compare equal by value, and a user's own
        # ``pltpu.InterpretParams()`` equal to one the front door injected is still the user's.
        self._injected: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._injected_strongly: dict[int, Any] = {}  # values that take no weak reference: kept alive
        self._verifying: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_guard_verifying", default=False)
        self._calling: contextvars.ContextVar[KernelInfo | None] = contextvars.ContextVar(
            "pallas_guard_calling", default=None
        )
        self._passed: dict[str, set[KernelInfo]] = {}
        self._left: dict[tuple[str, str | None], Left] = {}
        self._settled: dict[Hashable, Settled] = {}

    # --- injected interpret= values -------------------------------------------------------------

    def mark_injected(self, value: Any) -> None:
        """``value`` is an ``interpret=`` object the front door chose (it records that kernel)."""
        with self._lock:
            try:
                self._injected[id(value)] = value
            except TypeError:
                if len(self._injected_strongly) < _MAX_ENTRIES:
                    self._injected_strongly[id(value)] = value

    def is_injected(self, value: Any) -> bool:
        if not value or value is True:
            return False
        return self._injected.get(id(value)) is value or self._injected_strongly.get(id(value)) is value

    # --- verification ---------------------------------------------------------------------------

    def verifying(self) -> bool:
        return self._verifying.get()

    @contextlib.contextmanager
    def verification(self) -> Iterator[None]:
        """While the front door lowers a candidate on trial: the net substitutes the plain
        interpreter silently (no record, no warning, no refusal)."""
        token = self._verifying.set(True)
        try:
            yield
        finally:
            self._verifying.reset(token)

    def leave_to_net(
        self, kernel: KernelInfo, *, tried: tuple[str, ...], notes: tuple[str, ...], memory: tuple[MemoryUse, ...] = ()
    ) -> None:
        """The front door verified ``kernel`` and left it to the net's plain interpreter: what the
        net's record of it says besides its own reason."""
        with self._lock:
            if len(self._left) < _MAX_ENTRIES:
                self._left[kernel_key(kernel)] = Left(tried, notes, memory)

    def annotate(
        self,
        kernel: KernelInfo,
        call_site: CallSite,
        note: str,
        *,
        memory: tuple[MemoryUse, ...] = (),
        recorded: bool = False,
    ) -> None:
        """Add ``note`` (and ``memory``, the figures it states) to what the net will record of a
        kernel left to it, or else to the decision already recorded (learned after the front door
        committed: a check that could not apply at lowering, a compile that ran beside the kernel);
        ``recorded``: the net has recorded it already (learned once the program was lowered), and
        records it again where it lowers the kernel again."""
        with self._lock:
            left = self._left.get(kernel_key(kernel))
            if left is not None:
                notes = tuple(dict.fromkeys((*left.notes, note)))
                self._left[kernel_key(kernel)] = left._replace(notes=notes, memory=memory or left.memory)
                if not recorded:
                    return
        from pallas_guard._vocabulary import record as _record

        _record.annotate(kernel, call_site, note, memory=memory)

    def left_to_net(self, kernel: KernelInfo) -> Left:
        """What was tried, notes and memory figures for a kernel the front door left to the net;
        empty if none."""
        return self._left.get(kernel_key(kernel), Left((), (), ()))

    def handed_over(self, kernel: KernelInfo) -> bool:
        """Whether the front door verified ``kernel`` and left it to the net (its checks made there)."""
        with self._lock:
            return kernel_key(kernel) in self._left

    def saw(self, kernel: KernelInfo) -> bool:
        """Whether the front door handled ``kernel`` (left it to the net, or passed it on): one that
        reaches the net without it was built before ``install()``."""
        key = kernel_key(kernel)
        with self._lock:
            return key in self._left or any(kernel_key(k) == key for k in self._passed.get(kernel.name, ()))

    # --- the kernel being called -------------------------------------------------------------------

    @contextlib.contextmanager
    def calling(self, kernel: KernelInfo) -> Iterator[None]:
        """While the front door passes a call on: an eager call lowers inside it, and the net then
        names the kernel as the front door knows it (the traced jaxpr may not say where its body is
        defined: a callable object, a wrapper). A traced call lowers after it returns (under
        ``jax.jit``): the kernel is also kept by its name, for :meth:`passed`."""
        with self._lock:
            known = self._passed.setdefault(kernel.name, set())
            if len(known) < _MAX_ENTRIES and len(self._passed) < _MAX_ENTRIES:
                known.add(kernel)
        token = self._calling.set(kernel)
        try:
            yield
        finally:
            self._calling.reset(token)

    def called(self) -> KernelInfo | None:
        return self._calling.get()

    def passed(self, name: str) -> KernelInfo | None:
        """The kernel the front door passed on under ``name``, where exactly one was: what the net
        names a kernel by when the equation shows only JAX's own wrapper (``plgpu.kernel``)."""
        with self._lock:
            known = self._passed.get(name, set())
            return next(iter(known)) if len(known) == 1 else None

    # --- settled choices, by kernel identity ----------------------------------------------------

    def settled(self, identity: Hashable) -> Settled | None:
        with self._lock:
            return self._settled.get(identity)

    def settle(self, identity: Hashable, choice: Settled) -> None:
        with self._lock:
            if len(self._settled) < _MAX_ENTRIES:
                self._settled[identity] = choice

    def settled_count(self) -> int:
        with self._lock:
            return len(self._settled)

    def clear(self) -> None:
        with self._lock:
            self._injected.clear()
            self._injected_strongly.clear()
            self._left.clear()
            self._passed.clear()
            self._settled.clear()


class Guarding(Protocol):
    """What both layers read from the installation: whether it acts, its ledger, its nets."""

    active: bool
    ledger: Ledger
    hooks: list[Any]
    failure: str | None
    """Why the guard could not arm (which part failed), else None."""

    def is_active(self) -> bool: ...

    def failure_message(self) -> str: ...

    def lowering_net_gap(self, entry: EntryPoint) -> str | None: ...
