"""``install()`` / ``uninstall()``: the one code path every surface goes through, and the one
owner of what is installed (:data:`installation`)."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import pallas_guard_autoload

from . import _settings
from ._entry_points import ENTRY_POINTS, HOST_QUESTIONS, MODULES, EntryPoint, HostQuestion
from ._enums import Interpreter, Policy
from ._ledger import Ledger
from ._patch import Patch


@dataclasses.dataclass(frozen=True)
class Status:
    """What is installed right now (``doctor``, the pytest plugin, tests)."""

    requested: bool
    """``install()`` was called and not undone by ``uninstall()``."""
    active: bool
    """The wrappers and rules act (requested, and no internal error disabled them)."""
    failure: str | None
    """The internal error that disabled the guard, if one did."""
    patched: tuple[str, ...]
    lowering_rules: tuple[str, ...]
    lowering_net_gaps: dict[str, str]


class Installation:
    """The guard's lifecycle in this process: requested or not, what it patched and registered."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.requested = False
        self.active = False
        """Read by every wrapper and rule on every call: one attribute, no lock."""
        self.failure: str | None = None
        self.patches: list[Patch] = []
        self.rules: list[Any] = []
        self.hooks: list[Any] = []
        """What the bounds check wrapped in JAX (discharge rules, the interpreter's block copy), added
        at its first use; each ``restore()`` puts one back."""
        # Lowering net -> why it is not installed. The front door reads it: where the net is missing
        # it refuses with a diagnostic instead of deferring to a net that is not there.
        self.net_gaps: dict[str, str] = {}
        self.routes_via_mpmd = False
        self.ledger = Ledger()
        """What the front door and the lowering net share about kernels."""

    def is_active(self) -> bool:
        return self.active

    def lowering_net_gap(self, entry: EntryPoint) -> str | None:
        """Why no CPU lowering net catches kernels built by ``entry``; None when one does."""
        net = "mpmd_map" if entry.lowers_through_mpmd and self.routes_via_mpmd else "pallas_call"
        return self.net_gaps.get(net)

    # --- the lifecycle -------------------------------------------------------------------------

    def install(self, given: dict[str, _settings.Setting[Any]]) -> None:
        _settings.configure(given)  # raises on a bad value, before anything changes
        with self.lock:
            self.requested = True
            self.failure = None
            self.active = True
        finder = pallas_guard_autoload.finder()
        for module_name in MODULES:
            finder.register(module_name, self._on_import)
        if "jax" in sys.modules:  # else the device is applied when Pallas is imported
            from . import _device

            _device.apply()

    def uninstall(self) -> None:
        with self.lock:
            self.requested = False
            self._undo_locked()
        # Nothing outlives the guard: a later install() starts from the environment again, not
        # from what an earlier install() pinned.
        _settings.reset()

    def status(self) -> Status:
        with self.lock:
            return Status(
                requested=self.requested,
                active=self.active,
                failure=self.failure,
                patched=tuple(f"{p.owner.__name__}.{p.attribute}" for p in self.patches),
                lowering_rules=tuple(str(r.primitive) for r in self.rules),
                lowering_net_gaps=dict(self.net_gaps),
            )

    def _on_import(self, module: ModuleType) -> None:
        """Post-import callback: patch the entry points of ``module``. Never raises into an import."""
        with self.lock:
            if not self.requested or self.failure is not None:
                return
            try:
                for entry in ENTRY_POINTS:
                    if entry.module == module.__name__:
                        self._wrap_entry_point(module, entry)
                for question in HOST_QUESTIONS:
                    if question.module == module.__name__:
                        self._wrap_host_question(module, question)
                self._install_lowering_net()
                from . import _device, _tpu_rules

                _tpu_rules.install(self.hooks)

                _device.apply()
            except Exception as error:  # the user's import must not fail because of us
                self.failure = f"{type(error).__name__}: {error}"
                self._undo_locked()
                sys.stderr.write(
                    f"pallas_guard: disabled itself after an internal error while patching {module.__name__}: "
                    f"{self.failure}\n"
                )

    def _undo_locked(self) -> None:
        self.active = False
        self.ledger.clear()
        if "pallas_guard._device" in sys.modules:  # nothing to undo where it never ran
            sys.modules["pallas_guard._device"].undo()
        while self.patches:
            self.patches.pop().restore()
        while self.rules:
            self.rules.pop().remove()
        while self.hooks:
            self.hooks.pop().restore()
        self.net_gaps.clear()

    # --- what is installed -----------------------------------------------------------------------

    def _wrap_entry_point(self, module: ModuleType, entry: EntryPoint) -> None:
        attribute = entry.attribute
        # vars(): an attribute served by a module __getattr__ (pl.core_map from jax 0.11.2, with its
        # deprecation warning) is not patched; the lowering net covers it.
        original = vars(module).get(attribute)
        if original is None or _is_ours(original) or not callable(original):
            return
        from ._frontdoor import wrap_entry_point

        self._patch_function(module, attribute, original, wrap_entry_point(original, entry, self))

    def _wrap_host_question(self, module: ModuleType, question: HostQuestion) -> None:
        from ._frontdoor import wrap_host_question

        original = vars(module).get(question.attribute)
        if original is None:  # served by a deprecation __getattr__: wrap what it asks through
            from . import _internals

            inside = _internals.host_question_inside(question.attribute)
            if inside is None:
                return
            module, attribute = inside
            original = vars(module)[attribute]
            if not _is_ours(original):
                self._patch_function(module, attribute, original, wrap_host_question(original, question, self))
            return
        if not _is_ours(original) and callable(original):
            self._patch_function(module, question.attribute, original, wrap_host_question(original, question, self))

    def _patch_function(self, module: ModuleType, attribute: str, original: Any, wrapper: Any) -> None:
        """``module.attribute`` (and the same function where it is defined) replaced by ``wrapper``."""
        owners = [module]
        # Also patch the defining module: JAX's own callers (and PallasTest) look the function up there.
        defining = sys.modules.get(getattr(original, "__module__", "") or "")
        defined_as = getattr(original, "__name__", attribute)
        if defining is not None and defining is not module and vars(defining).get(defined_as) is original:
            owners.append(defining)
        for owner in owners:
            name = attribute if owner is module else defined_as
            self.patches.append(Patch(owner, name, original, wrapper))
            setattr(owner, name, wrapper)

    def _install_lowering_net(self) -> None:
        from . import _internals, _lowering

        if self.rules or self.net_gaps:
            return
        _internals.exclude_guard_frames_from_jax_tracebacks()
        from . import _findings

        _findings.hook(self.hooks)
        self.routes_via_mpmd = _internals.has_mpmd_module()
        nets = {"pallas_call": ("pallas_call", "pallas_call_p", _internals.pallas_call_primitive())}
        if self.routes_via_mpmd:
            nets["mpmd_map"] = ("pl.kernel/core_map (mpmd_map)", "mpmd_map_p", _internals.mpmd_map_primitive())
        registry = _internals.lowering_registry()
        if registry is None:
            _internals.note_missing("jax.interpreters.mlir registries", "the CPU lowering net is not installed")
        for net, (entry_point, name, primitive) in nets.items():
            if registry is not None and primitive is None:
                _internals.note_missing(name, f"the CPU lowering net for {entry_point} is not installed")
            installed = None
            if registry is not None and primitive is not None:
                installed = _lowering.install_rule(registry, primitive, entry_point, self)
            if installed is None:
                self.net_gaps[net] = (
                    f"the CPU lowering net for {entry_point} is not installed (JAX internals not found in "
                    f"jax {_internals.jax_version()}: {', '.join(sorted(_internals.missing))})"
                )
            else:
                self.rules.append(installed)


def _is_ours(value: object) -> bool:
    return bool(getattr(value, "_self_pallas_guard", False))


installation = Installation()


def install(
    policy: Policy | str | None = None,
    *,
    interpreter: Interpreter | str | None = None,
    checks: str | Iterable[str] | None = None,
    max_steps: int | str | None = None,
    device: str | Sequence[str] | None = None,
    fast_plain: bool | str | None = None,
) -> None:
    """Install the guard (idempotent). Settings not given keep a value set earlier through the API
    (until ``uninstall()``, which forgets them), else come from the ``PALLAS_GUARD_*`` variables.

    Raises ``PallasGuardConfigError`` (a ``ValueError``) for a bad variable or argument value and
    ``TypeError`` for an argument of the wrong type, before changing anything.
    """
    given = {
        "policy": policy,
        "interpreter": interpreter,
        "checks": checks,
        "max_steps": max_steps,
        "device": device,
        "fast_plain": fast_plain,
    }
    installation.install(_settings.given(given, call="install"))


def uninstall() -> None:
    """Remove the guard (idempotent): the original functions and lowering registries come back."""
    installation.uninstall()


def status() -> Status:
    return installation.status()


# --- `import pallas_guard` ---------------------------------------------------------------------------

# The functions of the stdlib ``site`` module that run .pth lines and the customize modules.
_SITE_FUNCTIONS = frozenset({"addpackage", "execsitecustomize", "execusercustomize"})


def during_site_startup() -> bool:
    """True while ``site`` is processing a ``.pth`` line or importing ``sitecustomize``."""
    frame = sys._getframe(1)  # noqa: SLF001 - a handful of frames, no source reads
    while frame is not None:
        if frame.f_code.co_name in _SITE_FUNCTIONS and frame.f_globals.get("__name__") == "site":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_CLI_MODULES = frozenset({"pallas_guard", "pallas_guard.__main__"})


def cli_startup() -> bool:
    """True in the ``pallas-guard`` CLI process, which reports a bad setting itself (``doctor``)."""
    script = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    if script in {"pallas-guard", "pallas-guard-script"}:
        return True
    # `python [options] -m pallas_guard ...`: sys.argv[0] is still "-m" while runpy imports us.
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    index = 0
    while index < len(argv):
        argument = argv[index]
        if argument == "-m":
            return index + 1 < len(argv) and argv[index + 1] in _CLI_MODULES
        if argument.startswith("-m"):
            return argument[2:] in _CLI_MODULES
        if argument == "-c" or not argument.startswith("-"):
            return False  # the interpreter's own options end here
        index += 2 if argument in {"-X", "-W"} else 1
    return False


def install_at_import() -> None:
    """What ``import pallas_guard`` does: a bare ``install()``.

    An explicit import with a bad value raises. Where raising would break more than the guard (the
    autoload's hook, a ``sitecustomize``), the guard is installed all the same with its settings
    unloaded, so the first kernel that reaches it raises the error, naming the variable, instead of
    running unguarded into JAX's own error; the ``pallas-guard`` CLI reports bad values itself.
    """
    try:
        install()
    except (ValueError, TypeError) as error:
        if cli_startup():
            return
        if not (pallas_guard_autoload.loading or during_site_startup()):
            raise
        with _settings.unsettled():
            install()
        pallas_guard_autoload.report_startup_error(error)
