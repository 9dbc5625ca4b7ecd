"""``decisions()``: what the guard did, oldest first; thread-safe."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ._enums import Policy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._diagnostics import KernelInfo


@dataclass(frozen=True, slots=True)
class Decision:
    """One thing the guard did (or chose not to do) with one Pallas kernel."""

    kernel: str
    """The kernel function's name (or the ``name=`` given to the entry point)."""
    defined_at: str | None
    """``file:line`` where the kernel function is defined."""
    called_at: str | None
    """``file:line`` of the user's call: the first frame outside jax and pallas_guard."""
    platforms: tuple[str, ...]
    """The platform(s) the kernel was being traced or lowered for."""
    policy: Policy
    action: str
    """``"interpreted"``, ``"refused"`` or ``"untouched"``."""
    interpreter: str | None
    """``"plain"``, ``"tpu"`` or ``"gpu"`` when interpreted, else None."""
    reason: str
    layer: str
    """``"front door"`` (trace time) or ``"lowering"`` (the CPU lowering rule)."""
    warned: bool = False
    entry_point: str = "pallas_call"

    def __repr__(self) -> str:
        how = f" with the {self.interpreter} interpreter" if self.interpreter else ""
        platforms = ",".join(self.platforms) or "?"
        return (
            f"<Decision {self.action}{how}: kernel {self.kernel!r} ({self.entry_point}, defined at "
            f"{self.defined_at or '?'}) called at {self.called_at or '?'} for {platforms} under policy "
            f"{self.policy.value} [{self.layer}]: {self.reason}>"
        )


_lock = threading.Lock()
_records: list[Decision] = []


def add(decision: Decision) -> None:
    with _lock:
        _records.append(decision)


def note(
    kernel: KernelInfo,
    *,
    called_at: str | None,
    platforms: tuple[str, ...],
    policy: Policy,
    action: str,
    interpreter: str | None,
    reason: str,
    layer: str,
    warned: bool = False,
) -> None:
    """Record what a layer did with ``kernel`` (the facts the diagnostics already gathered)."""
    add(
        Decision(
            kernel=kernel.name,
            defined_at=kernel.defined_at,
            called_at=called_at,
            platforms=platforms,
            policy=policy,
            action=action,
            interpreter=interpreter,
            reason=reason,
            layer=layer,
            warned=warned,
            entry_point=kernel.entry_point,
        )
    )


def snapshot() -> list[Decision]:
    with _lock:
        return list(_records)


def clear() -> None:
    with _lock:
        _records.clear()
