"""``decisions()``: what the guard did, oldest first; thread-safe."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from pallas_guard._vocabulary.enums import Policy
from pallas_guard_autoload import printable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

    from pallas_guard._deciding.diagnostics import CallSite, KernelInfo


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """What a kernel takes of one memory of one TPU generation or GPU, by the target's compiler (the
    ``compile`` check), whether it compiled there or was refused."""

    generation: str
    """The device setting's name for the target: ``"tpu-v5e"``, ``"tpu7x"``, ``"h100"``, ..."""
    space: str
    """TPU: ``"VMEM"``: the compiler's scoped allocation (each block, double-buffered, and its own
    scratch), held to the scoped limit (``vmem_limit_bytes``, else the generation's default);
    ``"VMEM scratch"``: the kernel's ``scratch_shapes`` in VMEM, held to the TensorCore's whole
    VMEM; ``"SMEM"``: the SMEM operands the kernel declares (an estimate: libtpu reports none).
    GPU: ``"shared memory"``: a block's dynamic shared memory, held to what one block may have;
    ``"registers"``: ptxas's registers per thread (a count, not bytes), held to 255; ``"spill
    stores"``: bytes ptxas spilled to local memory (limit 0: a kernel that fits spills none)."""
    used: int
    """Bytes (registers: a count)."""
    limit: int
    """Bytes the target gives it (registers: a count)."""
    compiled: bool
    """Whether the kernel compiled for this target (a refused kernel's figure is the refusal's)."""

    @property
    def share(self) -> float:
        """``used / limit``: above 1 the compiler refuses the kernel (a spill: infinite)."""
        if not self.limit:
            return float("inf") if self.used else 0.0
        return self.used / self.limit

    def amount(self, count: int) -> str:
        """``count`` in this space's unit: ``74`` registers, else bytes (``64.0 KiB``)."""
        return str(count) if self.space == "registers" else size(count)

    def __str__(self) -> str:
        if not self.limit:
            return f"{self.space} {self.amount(self.used)}"
        per = " per thread" if self.space == "registers" else ""
        return f"{self.space} {self.amount(self.used)} of {self.amount(self.limit)}{per} ({self.share:.0%})"


def size(count: int) -> str:
    """``448.0 KiB``, ``16.0 MiB``, ``8 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


@dataclass(frozen=True, slots=True)
class Decision:
    """One thing the guard did (or chose not to do) with one Pallas kernel."""

    kernel: str
    """The kernel function's name (or the ``name=`` given to the entry point)."""
    defined_at: str | None
    """``file:line`` where the kernel function is defined."""
    called_at: str | None
    """``file:line`` of the user's call: the first frame in the user's own code (not jax,
    pallas_guard, the standard library or an installed distribution)."""
    platforms: tuple[str, ...]
    """The platform(s) the kernel was being traced or lowered for."""
    policy: Policy
    action: str
    """``"interpreted"``, ``"refused"``, ``"untouched"``, or ``"found"`` (a check's finding)."""
    interpreter: str | None
    """``"plain"``, ``"tpu"`` or ``"gpu"`` when interpreted, else None."""
    reason: str
    """Why, in the plan's words: the policy and target, the interpreter's choice, what was tried."""
    layer: str
    """``"front door"`` (decided when the kernel was called, before JAX traced it) or ``"lowering"``
    (decided when JAX lowered it for the CPU)."""
    warned: bool = False
    entry_point: str = "pallas_call"
    via: str | None = None
    """``file:line`` of the library code that called the entry point on the user's behalf, if any."""
    tried: tuple[str, ...] = ()
    """The interpreters verified before the choice, in order, each with its outcome."""
    steps: int | None = None
    """The grid steps an interpreted kernel runs (or would have run, refused over the budget)."""
    policy_source: str = ""
    """Where the policy came from: ``PALLAS_GUARD_POLICY``, ``PALLAS_INTERPRET``, an API call, ..."""
    notes: tuple[str, ...] = ()
    """What the checks asked for mean for this kernel: that they cannot apply to it, and why; or
    that they chose an interpreter much slower than the one it runs in unchecked."""
    why: str = ""
    """The one reason sentence every surface prints: ``reason``, and where it was decided, in words."""
    check: str | None = None
    """The check whose finding this is (action ``"found"``), else None."""
    memory: tuple[MemoryUse, ...] = ()
    """What the kernel takes of each TPU generation's VMEM and SMEM, where the ``compile`` check
    compiled it (refused kernels included), tightest first."""

    def __repr__(self) -> str:
        how = f" with the {self.interpreter} interpreter" if self.interpreter else ""
        platforms = ",".join(self.platforms) or "?"
        # Paths and names are the user's: escaped, so a repr in a log is one line, uncoloured.
        return printable(
            f"<Decision {self.action}{how}: kernel {self.kernel!r} ({self.entry_point}, defined at "
            f"{self.defined_at or '?'}) called at {self.called_at or '?'}"
            f"{f' via {self.via}' if self.via else ''} for {platforms} under policy "
            f"{self.policy.value}: {self.why or self.reason}>"
        )


# Pickled, and shown, by the name users import: a pickle does not depend on where the class lives.
Decision.__module__ = MemoryUse.__module__ = "pallas_guard"

_lock = threading.Lock()
_records: list[Decision] = []


def add(decision: Decision) -> None:
    with _lock:
        _records.append(decision)


def note(
    kernel: KernelInfo,
    *,
    called_at: CallSite,
    platforms: tuple[str, ...],
    policy: Policy,
    action: str,
    interpreter: str | None,
    reason: str,
    layer: str,
    warned: bool = False,
    tried: tuple[str, ...] = (),
    steps: int | None = None,
    policy_source: str = "",
    notes: tuple[str, ...] = (),
    why: str = "",
    check: str | None = None,
    memory: tuple[MemoryUse, ...] = (),
) -> None:
    """Record what a layer did with ``kernel`` (the facts the diagnostics already gathered)."""
    add(
        Decision(
            kernel=kernel.name,
            defined_at=kernel.defined_at,
            called_at=called_at.user,
            platforms=platforms,
            policy=policy,
            action=action,
            interpreter=interpreter,
            reason=reason,
            layer=layer,
            warned=warned,
            entry_point=kernel.entry_point,
            via=called_at.via,
            tried=tried,
            steps=steps,
            policy_source=policy_source,
            notes=notes,
            why=why,
            check=check,
            memory=memory,
        )
    )


_collecting = threading.local()


@contextlib.contextmanager
def collecting_notes(into: list[str]) -> Iterator[None]:
    """Inside, in this thread, notes go to ``into``: the decision they belong to is recorded after
    (a trial lowering, before the front door commits to the interpreter it tried)."""
    previous = getattr(_collecting, "notes", None)
    _collecting.notes = into
    try:
        yield
    finally:
        _collecting.notes = previous


def annotate(kernel: KernelInfo, called_at: CallSite, note_text: str, *, memory: tuple[MemoryUse, ...] = ()) -> None:
    """Add ``note_text`` to the latest decision about ``kernel`` called at ``called_at`` (a note a
    layer learns after it recorded the decision, as when a check cannot be applied at lowering),
    or to the notes being collected for a decision not yet recorded; ``memory``, where given,
    becomes that decision's figures."""
    import dataclasses

    collected = getattr(_collecting, "notes", None)
    if collected is not None:
        if note_text not in collected:
            collected.append(note_text)
        return
    with _lock:
        position = _latest(kernel, called_at)
        if position is not None:
            decision = _records[position]
            notes = decision.notes if note_text in decision.notes else (*decision.notes, note_text)
            _records[position] = dataclasses.replace(decision, notes=notes, memory=memory or decision.memory)


def withdraw(kernel: KernelInfo, called_at: CallSite, *, action: str) -> None:
    """Take back the latest decision ``action`` about ``kernel`` called at ``called_at``: what was
    recorded as the kernel was lowered, before a check that judged later refused it unrun."""
    with _lock:
        position = _latest(kernel, called_at, action=action)
        if position is not None:
            del _records[position]


def _latest(kernel: KernelInfo, called_at: CallSite, *, action: str | None = None) -> int | None:
    """Where the latest decision about ``kernel`` called at ``called_at`` (of ``action``, where
    given) is in the record; the caller holds the lock."""
    for position in range(len(_records) - 1, -1, -1):
        decision = _records[position]
        same_call = decision.kernel == kernel.name and decision.called_at == called_at.user
        if same_call and (action is None or decision.action == action):
            return position
    return None


def snapshot() -> list[Decision]:
    with _lock:
        return list(_records)


def clear() -> None:
    with _lock:
        _records.clear()
