"""``install()`` / ``uninstall()``: the one code path every surface goes through, and the one
owner of what is installed (:data:`installation`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import pallas_guard_autoload
from pallas_guard._guard.ledger import Ledger
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.entry_points import ENTRY_POINTS, HOST_QUESTIONS, MODULES, EntryPoint, HostQuestion
from pallas_guard._vocabulary.enums import Interpreter, Policy
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.patch import Patch


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
        self.summary_at_exit = False
        """Whether this process prints its TPU memory figures at exit (``pallas-guard run``)."""
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
            if self.failure is not None:  # a retry: the rules that explained the failure go first
                self._undo_locked()
            self.requested = True
            self.failure = None
            self.active = True
        finder = pallas_guard_autoload.finder()
        for module_name in MODULES:
            finder.register(module_name, self._on_import)
        if os.environ.get(pallas_guard_autoload.EXIT_SUMMARY_ENV) and not self.summary_at_exit:
            import atexit

            from pallas_guard._surfaces import report as _report

            self.summary_at_exit = True
            atexit.register(_report.summary_at_exit)
        if "jax" in sys.modules:  # else the device is applied when Pallas is imported
            from pallas_guard._deciding import device as _device

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
        """Post-import callback: arm the guard for ``module``. It arms, or says so at once: where a
        part fails, everything is undone, each kernel that lowers for the CPU is refused with the
        reason (never JAX's bare error), and the failure is one line on stderr, or, where a policy
        was given and this runs outside an import (``install()``), a ``PallasGuardError``."""
        with self.lock:
            if not self.requested:
                return
            if self.failure is None:
                self._arm(module)
            if self.failure is None:
                return
            message = self.failure_message()
        policy = _settings.current_policy()
        if policy.value is Policy.OFF:  # JAX's own behaviour was asked for: nothing to arm for
            return
        if policy.source != "default" and not pallas_guard_autoload.in_import_hook():
            raise PallasGuardError(message)
        pallas_guard_autoload.say_once("_pallas_guard_unarmed", ["pallas_guard: " + " ".join(message.split())])

    def _arm(self, module: ModuleType) -> None:
        from pallas_guard._jax import lookup as jax_lookup

        part = f"wrapping the entry points of {module.__name__}"
        try:
            # JAX's own warnings while the guard looks it over (a deprecated name) are not the user's.
            with jax_lookup.probing():
                for entry in ENTRY_POINTS:
                    if module.__name__ in entry.modules:
                        self._wrap_entry_point(module, entry)
                for question in HOST_QUESTIONS:
                    if module.__name__ in question.modules:
                        self._wrap_host_question(module, question)
                part = "installing the CPU lowering net"
                self._install_lowering_net()
                from pallas_guard._deciding import device as _device
                from pallas_guard._running import tpu_rules as _tpu_rules

                part = "installing the TPU lowering rules"
                _tpu_rules.install(self.hooks)
                part = "presenting the device setting"
                _device.apply()
        except Exception as error:  # the user's import must not fail silently because of us
            self.failure = f"{part} failed: {type(error).__name__}: {error}"
            self._undo_locked()
            self._explain_unarmed()

    def failure_message(self) -> str:
        """What the guard says where it could not arm: which part failed, on which jax, what to do."""
        from pallas_guard._deciding import diagnostics as _diagnostics

        return _diagnostics.not_armed(self.failure or "")

    def _explain_unarmed(self) -> None:
        """Where arming failed, a CPU rule that refuses each kernel JAX would refuse anyway ("Only
        interpret mode is supported on CPU backend") with the guard's reason. Best effort: where even
        that cannot be registered, the import's error and the line on stderr remain."""
        from pallas_guard._guard import lowering_net as _lowering
        from pallas_guard._jax import lookup as jax_lookup
        from pallas_guard._jax import lowering as jax_lowering
        from pallas_guard._jax import pallas as jax_pallas

        try:
            with jax_lookup.probing():
                registry = jax_lowering.lowering_registry()
                primitives = (jax_pallas.pallas_call_primitive(), jax_pallas.mpmd_map_primitive())
                for primitive in primitives:
                    if registry is not None and primitive is not None:
                        installed = _lowering.install_unarmed_rule(registry, primitive, self)
                        if installed is not None:
                            self.rules.append(installed)
        except Exception:
            return  # the failure it would explain is raised or printed all the same

    def _undo_locked(self) -> None:
        self.active = False
        self.ledger.clear()
        if "pallas_guard._deciding.device" in sys.modules:  # nothing to undo where it never ran
            sys.modules["pallas_guard._deciding.device"].undo()
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
        if original is None or not callable(original):
            return
        if _is_ours(original):
            # One public module binds what another already bound (jax.experimental.pallas takes
            # jax.pallas's names, 0.12.1+): ours already, but put back here too on uninstall.
            self._record_bound(module, attribute, original)
            return
        from pallas_guard._guard.frontdoor import wrap_entry_point

        self._patch_function(module, attribute, original, wrap_entry_point(original, entry, self))

    def _wrap_host_question(self, module: ModuleType, question: HostQuestion) -> None:
        from pallas_guard._guard.frontdoor import wrap_host_question

        original = vars(module).get(question.attribute)
        if original is None:  # served by a deprecation __getattr__: wrap what it asks through
            from pallas_guard._jax import pallas as jax_pallas

            inside = jax_pallas.host_question_inside(question.attribute)
            if inside is None:
                return
            module, attribute = inside
            original = vars(module)[attribute]
            if not _is_ours(original):
                self._patch_function(module, attribute, original, wrap_host_question(original, question, self))
            return
        if _is_ours(original):
            self._record_bound(module, question.attribute, original)
        elif callable(original):
            wrapper = wrap_host_question(original, question, self)
            self._patch_function(module, question.attribute, original, wrapper, holders=question.holders)

    def _record_bound(self, module: ModuleType, attribute: str, wrapper: Any) -> None:
        """``module.attribute`` holds a wrapper of ours it took from another module: put it back too."""
        if not any(patch.owner is module and patch.attribute == attribute for patch in self.patches):
            self.patches.append(Patch(module, attribute, wrapper.__wrapped__, wrapper))

    def _patch_function(
        self, module: ModuleType, attribute: str, original: Any, wrapper: Any, *, holders: Sequence[str] = ()
    ) -> None:
        """``module.attribute`` (and the same function where it is defined, and in ``holders``, JAX's
        modules that may hold it under the same name) replaced by ``wrapper``; where the defining
        module already holds our wrapper of that function (another public module armed first:
        jax.pallas and jax.experimental.pallas), that one wrapper serves both."""
        owners = [(module, attribute)]
        # Also patch the defining module: JAX's own callers (and PallasTest) look the function up there.
        defining = sys.modules.get(getattr(original, "__module__", "") or "")
        defined_as = getattr(original, "__name__", attribute)
        there = vars(defining).get(defined_as) if defining is not None and defining is not module else None
        if there is original:
            owners.append((defining, defined_as))  # type: ignore[arg-type]
        elif there is not None and _is_ours(there) and there.__wrapped__ is original:
            wrapper = there
        for name in holders:
            holder = sys.modules.get(name)
            if (
                holder is not None
                and all(holder is not o for o, _ in owners)
                and vars(holder).get(attribute) is original
            ):
                owners.append((holder, attribute))
        for owner, name in owners:
            self.patches.append(Patch(owner, name, original, wrapper))
            setattr(owner, name, wrapper)

    def _install_lowering_net(self) -> None:
        from pallas_guard._guard import lowering_net as _lowering
        from pallas_guard._jax import lookup as jax_lookup
        from pallas_guard._jax import lowering as jax_lowering
        from pallas_guard._jax import pallas as jax_pallas
        from pallas_guard._jax import source as jax_source

        if self.rules or self.net_gaps:
            return
        jax_source.exclude_guard_frames_from_jax_tracebacks()
        from pallas_guard._checks import checked_plain
        from pallas_guard._running import findings as _findings

        _findings.hook(
            self.hooks,
            checking_at_run_time=lambda: bool(checked_plain.plain(_settings.current("checks").value)),
        )
        self.routes_via_mpmd = jax_pallas.has_mpmd_module()
        nets = {"pallas_call": ("pallas_call", "pallas_call_p", jax_pallas.pallas_call_primitive())}
        if self.routes_via_mpmd:
            nets["mpmd_map"] = ("pl.kernel/core_map (mpmd_map)", "mpmd_map_p", jax_pallas.mpmd_map_primitive())
        registry = jax_lowering.lowering_registry()
        if registry is None:
            jax_lookup.note_missing("jax.interpreters.mlir registries", "the CPU lowering net is not installed")
        for net, (entry_point, name, primitive) in nets.items():
            if registry is not None and primitive is None:
                jax_lookup.note_missing(name, f"the CPU lowering net for {entry_point} is not installed")
            installed = None
            if registry is not None and primitive is not None:
                installed = _lowering.install_rule(registry, primitive, entry_point, self)
            if installed is None:
                self.net_gaps[net] = (
                    f"the CPU lowering net for {entry_point} is not installed (JAX internals not found in "
                    f"jax {jax_lookup.jax_version()}: {', '.join(sorted(jax_lookup.missing))})"
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
    require_checks: bool | str | None = None,
    vmem_headroom: float | str | None = None,
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
        "require_checks": require_checks,
        "vmem_headroom": vmem_headroom,
    }
    installation.install(_settings.given(given, call="install"))


def uninstall() -> None:
    """Remove the guard (idempotent): the original functions and lowering registries come back."""
    installation.uninstall()


def status() -> Status:
    return installation.status()


class Armed(NamedTuple):
    """Whether the guard is armed in this process, found by arming it (``doctor``, the pytest header
    and summary): never assumed from the settings."""

    armed: bool
    text: str


def arm() -> Armed:
    """Import Pallas (which arms the guard, as a user's import would) and say what is in place: the
    front door's entry points and the CPU lowering nets, or which part failed and why."""
    from pallas_guard._jax import lookup as jax_lookup

    if importlib.util.find_spec("jax") is None:
        return Armed(False, "not armed: jax is not installed")
    with installation.lock:
        requested, failure = installation.requested, installation.failure
    if not requested:
        return Armed(False, "not armed: no policy is set (the guard is not installed)")
    if failure is None:  # a failure to arm is recorded on the installation, and reported below
        with contextlib.suppress(Exception):
            jax_lookup.import_optional("jax.pallas")  # Pallas's public face from jax 0.12.1 (None before)
        with contextlib.suppress(Exception):
            jax_lookup.import_optional("jax.experimental.pallas")
    now = installation.status()
    if now.failure is not None:
        return Armed(False, "NOT ARMED: " + installation.failure_message())
    version = jax_lookup.jax_version()
    if not now.active or not now.patched:
        return Armed(False, f"NOT ARMED on jax {version}: nothing of Pallas is wrapped (active={now.active})")
    entries = sorted({name.rpartition(".")[2] for name in now.patched})
    nets = ", ".join(now.lowering_rules) or "none"
    gaps = "; ".join(now.lowering_net_gaps.values())
    text = f"armed on jax {version}: entry points {', '.join(entries)} wrapped; CPU lowering rules on {nets}"
    return Armed(not gaps, text + (f"; NOT ARMED: {gaps}" if gaps else ""))


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
    except (pallas_guard_autoload.PallasGuardConfigError, TypeError) as error:
        if cli_startup():
            return
        if not (pallas_guard_autoload.loading or during_site_startup()):
            raise
        with _settings.unsettled():
            install()
        pallas_guard_autoload.report_startup_error(error)
