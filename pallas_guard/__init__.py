"""pallas_guard: Pallas kernels written for GPU/TPU behave well where they would lower for the CPU.

``import pallas_guard`` installs the guard with the policy from ``PALLAS_GUARD_POLICY`` (default
``warn``). It imports neither jax nor wrapt: the patch is applied when ``jax.experimental.pallas``
is imported, before or after this module.
"""

from __future__ import annotations

from . import _autoload, _policy
from ._errors import PallasGuardConfigError, PallasGuardError, PallasGuardWarning
from ._install import install, uninstall

# Not `from typing import ...`: typing (and the re it imports) is ~40% of the cost of importing
# pallas_guard at interpreter start-up; annotations are strings here, only the checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._enums import Interpreter, Policy
    from ._record import Decision

__all__ = (
    "Decision",
    "Interpreter",
    "PallasGuardConfigError",
    "PallasGuardError",
    "PallasGuardWarning",
    "Policy",
    "clear_decisions",
    "decisions",
    "get_policy",
    "install",
    "policy",
    "set_policy",
    "uninstall",
)


def get_policy() -> Policy:
    """The policy in effect here: the innermost ``policy()`` scope, else the process policy."""
    return _policy.current_policy().value


def set_policy(policy: Policy | str) -> None:
    """Set the process-wide policy (a ``policy()`` scope still overrides it inside its block)."""
    _policy.set_process_policy(_policy.parse_policy(policy, source="set_policy(policy)"), "set_policy()")


def policy(policy: Policy | str | None = None, *, interpreter: Interpreter | str | None = None) -> _policy.scoped:
    """Override the policy (and/or interpreter) inside a ``with`` block; thread- and task-local.

    Bad values raise here, before the block. The policy applies when a function is traced: a
    function jitted before the block keeps its executable (``jax.clear_caches()`` to re-trace).
    """
    parsed_policy = None if policy is None else _policy.parse_policy(policy, source="policy(policy)")
    parsed_interpreter = (
        None if interpreter is None else _policy.parse_interpreter(interpreter, source="policy(interpreter=...)")
    )
    return _policy.scoped(parsed_policy, parsed_interpreter, "pallas_guard.policy() scope")


def decisions() -> list[Decision]:
    """What the guard did, oldest first: one :class:`Decision` per kernel it saw lowered or refused."""
    from . import _record

    return _record.snapshot()


def clear_decisions() -> None:
    """Forget the recorded decisions."""
    from . import _record

    _record.clear()


def __getattr__(name: str) -> Any:
    # Built on first use, not at interpreter start-up: the enums need `enum` (with functools and
    # collections), the records `dataclasses`.
    if name in ("Policy", "Interpreter"):
        from . import _enums

        return getattr(_enums, name)
    if name == "Decision":
        from ._record import Decision

        return Decision
    raise AttributeError(f"module 'pallas_guard' has no attribute {name!r}")


# From the environment; at interpreter start-up (.pth, sitecustomize) a bad value prints one line
# instead of raising: see _autoload.
_autoload.install_at_import()
