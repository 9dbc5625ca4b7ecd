"""pallas_guard: Pallas kernels written for GPU/TPU behave well where they would lower for the CPU.

``import pallas_guard`` installs the guard with the settings from the ``PALLAS_GUARD_*`` variables
(policy default ``warn``). It imports neither jax nor wrapt: the patch is applied when
``jax.experimental.pallas`` is imported, before or after this module.

PYTEST_DONT_REWRITE (nothing to rewrite here; pytest would warn if we were imported before it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Sequence

from pallas_guard._surfaces import install as _install
from pallas_guard._surfaces.install import install, uninstall
from pallas_guard._vocabulary import errors as _errors
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.enums import Interpreter, Policy
from pallas_guard._vocabulary.errors import PallasGuardError, PallasGuardWarning
from pallas_guard._vocabulary.record import Decision, MemoryUse
from pallas_guard_autoload import PallasGuardConfigError

__all__ = (
    "Decision",
    "Interpreter",
    "MemoryUse",
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
    return _settings.current_policy().value


def set_policy(policy: Policy | str) -> None:
    """Set the process-wide policy (a ``policy()`` scope still overrides it inside its block).

    It stays set: a later bare ``install()`` or ``importlib.reload(pallas_guard)`` keeps it.
    """
    source = "set_policy()"
    _settings.pin("policy", _settings.Setting(_settings.parse("policy", policy, "set_policy(policy)"), source))
    if _install.installation.active:
        from pallas_guard._deciding import device as _device

        _device.apply()  # a device is presented only while the guard interprets


def policy(
    policy: Policy | str | None = None,
    *,
    interpreter: Interpreter | str | None = None,
    checks: str | Iterable[str] | None = None,
    max_steps: int | str | None = None,
    device: str | Sequence[str] | None = None,
    fast_plain: bool | str | None = None,
    require_checks: bool | str | None = None,
    vmem_headroom: float | str | None = None,
) -> _settings.AbstractContextManager[None]:
    """Override settings inside a ``with`` block; thread- and task-local.

    ``checks``: ``"races"``, ``"bounds"``, ``"agree"``, ``"lowering"``, ``"compile"`` (a comma
    list or an iterable), ``"all"`` (every check but ``"agree"``, which ``"all,agree"`` adds)
    or ``"none"``; ``fast_plain``: False runs JAX's plain
    interpreter as it ships; ``max_steps``: the most grid steps an interpreted kernel may run;
    ``device``: the TPU/GPU host code is told it runs on (``"tpu-v5e"``, ``"h100"``, ... or
    ``"none"``), or several (a comma list or a sequence: host code is told the first, each kernel
    family is lowered for the first of its platform, the compile check compiles for every TPU
    generation listed); ``require_checks``: True makes a check asked for that cannot run on a
    kernel fail its call instead of leaving a note; ``vmem_headroom``: a share (``0.05``, ``"5%"``)
    of a TPU generation's VMEM limit a kernel the compile check compiles must leave free, else
    it is a finding. Bad values raise here,
    before the block. Settings apply where a kernel is called and lowered: a function jitted before
    the block keeps its executable (``jax.clear_caches()`` to re-trace).
    """
    given = {
        "policy": policy,
        "interpreter": interpreter,
        "checks": checks,
        "max_steps": max_steps,
        "device": device,
        "fast_plain": fast_plain,
        "require_checks": require_checks,
        "vmem_headroom": vmem_headroom,
    }
    return _scope(_settings.given(given, call="policy", source="pallas_guard.policy() scope"))


@contextlib.contextmanager
def _scope(overrides: dict[str, _settings.Setting[object]]) -> Iterator[None]:
    with _settings.scope(overrides):
        if not _install.installation.active:
            yield
            return
        from pallas_guard._deciding import device as _device

        with _device.scoped():
            yield


def decisions() -> list[Decision]:
    """What the guard did, oldest first: one :class:`Decision` per kernel it saw lowered or refused."""
    return _record.snapshot()


def clear_decisions() -> None:
    """Forget the recorded decisions."""
    _record.clear()


# A Decision pickled by a pallas_guard whose modules were not yet in layer folders names its class
# `pallas_guard._record.Decision`; it still loads (pickles made now name `pallas_guard.Decision`).
sys.modules.setdefault(f"{__name__}._record", _record)

_errors.apply_startup_warning_options()
_install.install_at_import()
