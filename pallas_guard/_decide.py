"""The decision table: one pure function, used by the front door and by the lowering net."""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._enums import Policy
from ._target import is_accelerator


class Action(enum.StrEnum):
    UNTOUCHED = "untouched"
    """Do exactly what JAX would have done."""
    INTERPRET = "interpret"
    """Run the kernel with an interpreter (and warn, when ``Verdict.warn``)."""
    REFUSE = "refuse"
    """Raise ``PallasGuardError``."""
    DEFER = "defer"
    """The target is unknown here; the lowering net, which knows it, decides."""


class Verdict(NamedTuple):
    action: Action
    warn: bool
    reason: str


def decide(  # noqa: PLR0911 - one return per row of the table
    *, policy: Policy, platform: str | None, interpret: object, forced_by_jax: object = None
) -> Verdict:
    """Apply the table in README "How it decides" to one kernel.

    ``interpret`` is what the caller passed (absent counts as False); ``forced_by_jax`` is the value
    of JAX's own ``force_*_interpret_mode`` switch, which JAX applies itself when truthy.
    """
    if interpret:
        return Verdict(Action.UNTOUCHED, False, f"explicit interpret={interpret!r}")
    if forced_by_jax:
        return Verdict(Action.UNTOUCHED, False, f"JAX's force_*_interpret_mode is active ({forced_by_jax!r})")
    if platform is None:
        return Verdict(Action.DEFER, False, "target unknown at trace time; decided at lowering")
    if platform != "cpu":
        kind = "an accelerator" if is_accelerator(platform) else "not the CPU"
        return Verdict(Action.UNTOUCHED, False, f"target {platform!r} is {kind}")
    if policy is Policy.OFF:
        return Verdict(Action.UNTOUCHED, False, "policy off: JAX's own CPU error applies")
    if policy is Policy.STRICT:
        return Verdict(Action.REFUSE, False, "policy strict: no interpreter without interpret=")
    return Verdict(Action.INTERPRET, policy is Policy.WARN, f"policy {policy.value}: target is the CPU")
