"""pallas_guard: Pallas kernels written for GPU/TPU behave well where they would lower for the CPU.

``import pallas_guard`` installs the guard with the policy from ``PALLAS_GUARD_POLICY`` (default
``warn``). It imports neither jax nor wrapt: the patch is applied when ``jax.experimental.pallas``
is imported, before or after this module.
"""

from __future__ import annotations

import contextlib

from . import _autoload, _policy
from ._errors import PallasGuardConfigError, PallasGuardError, PallasGuardWarning
from ._install import install, uninstall
from ._policy import Interpreter, Policy

# Not `from typing import ...`: typing (and the re it imports) is ~40% of the cost of importing
# pallas_guard at interpreter start-up; annotations are strings here, only the checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

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
    value = _policy.current_policy().value
    assert isinstance(value, Policy)
    return value


def set_policy(policy: Policy | str) -> None:
    """Set the process-wide policy (a ``policy()`` scope still overrides it inside its block)."""
    _policy.set_process_policy(_policy.parse_policy(policy, source="set_policy(policy)"), "set_policy()")


@contextlib.contextmanager
def policy(policy: Policy | str | None = None, *, interpreter: Interpreter | str | None = None) -> Iterator[None]:
    """Override the policy (and/or interpreter) inside a ``with`` block; thread- and task-local.

    The policy applies when a function is traced: a function jitted before the block keeps its
    executable (``jax.clear_caches()`` to re-trace).
    """
    parsed_policy = None if policy is None else _policy.parse_policy(policy, source="policy(policy)")
    parsed_interpreter = (
        None if interpreter is None else _policy.parse_interpreter(interpreter, source="policy(interpreter=...)")
    )
    with _policy.scoped(parsed_policy, parsed_interpreter, "pallas_guard.policy() scope"):
        yield


def decisions() -> list[Decision]:
    """What the guard did, oldest first: one :class:`Decision` per kernel it saw lowered or refused."""
    from . import _record

    return _record.snapshot()


def clear_decisions() -> None:
    """Forget the recorded decisions."""
    from . import _record

    _record.clear()


def __getattr__(name: str) -> Any:
    # Decision lives with the records, which import dataclasses: only when first asked for.
    if name == "Decision":
        from ._record import Decision

        return Decision
    raise AttributeError(f"module 'pallas_guard' has no attribute {name!r}")


# From the environment; at interpreter start-up (.pth, sitecustomize) a bad value prints one line
# instead of raising: see _autoload.
_autoload.install_at_import()
