"""``install()`` / ``uninstall()``: the one code path every surface goes through."""

from __future__ import annotations

import _thread
import sys

from . import _hook, _policy, _state

# Only the type checker needs these (see pallas_guard/__init__.py): this module loads at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

PALLAS_MODULE = "jax.experimental.pallas"
MOSAIC_GPU_MODULE = "jax.experimental.pallas.mosaic_gpu"

# (module attribute, entry-point label) patched when each module is imported.
_ENTRY_POINTS = {
    PALLAS_MODULE: (("pallas_call", "pallas_call"), ("kernel", "pl.kernel"), ("core_map", "pl.core_map")),
    MOSAIC_GPU_MODULE: (("kernel", "plgpu.kernel"),),
}

_lock = _thread.RLock()  # threading.RLock is this C lock; `import threading` costs more
_requested = False
_failure: str | None = None


class _Patch:
    """One module attribute replaced by a wrapper, and the exact object to put back."""

    def __init__(self, owner: ModuleType, attribute: str, original: Any, wrapper: Any) -> None:
        self.owner, self.attribute, self.original, self.wrapper = owner, attribute, original, wrapper

    def restore(self) -> None:
        if vars(self.owner).get(self.attribute) is self.wrapper:  # leave a user's own replacement
            setattr(self.owner, self.attribute, self.original)


_patches: list[_Patch] = []
_rules: list[Any] = []
# Lowering net -> why it is not installed. The front door reads it: where the net is missing it
# refuses with a diagnostic instead of deferring to a net that is not there.
_net_gaps: dict[str, str] = {}
_routes_via_mpmd = False


def lowering_net_gap(entry_point: str) -> str | None:
    """Why no CPU lowering net catches kernels built by ``entry_point``; None when one does."""
    net = "mpmd_map" if entry_point != "pallas_call" and _routes_via_mpmd else "pallas_call"
    return _net_gaps.get(net)


def _is_ours(value: object) -> bool:
    return bool(getattr(value, "_self_pallas_guard", False))


def _wrap_entry_point(module: ModuleType, attribute: str, entry_point: str) -> None:
    # vars(): an attribute served by a module __getattr__ (pl.core_map from jax 0.11.2, with its
    # deprecation warning) is not patched; the lowering net covers it.
    original = vars(module).get(attribute)
    if original is None or _is_ours(original) or not callable(original):
        return
    import wrapt

    from ._frontdoor import make_wrapper

    wrapper = wrapt.FunctionWrapper(original, make_wrapper(entry_point))
    # wrapt keeps `_self_`-prefixed attributes on the proxy itself: our marker for idempotence.
    wrapper._self_pallas_guard = True  # type: ignore[attr-defined]  # noqa: SLF001
    owners = [module]
    # Also patch the defining module: JAX's own callers (and PallasTest) look the function up there.
    defining = sys.modules.get(getattr(original, "__module__", "") or "")
    defined_as = getattr(original, "__name__", attribute)
    if defining is not None and defining is not module and vars(defining).get(defined_as) is original:
        owners.append(defining)
    for owner in owners:
        name = attribute if owner is module else defined_as
        _patches.append(_Patch(owner, name, original, wrapper))
        setattr(owner, name, wrapper)


def _install_lowering_net() -> None:
    global _routes_via_mpmd  # noqa: PLW0603
    from . import _internals, _lowering

    if _rules or _net_gaps:
        return
    _internals.exclude_guard_frames_from_jax_tracebacks()
    _routes_via_mpmd = _internals.has_mpmd_module()
    nets = {"pallas_call": ("pallas_call", "pallas_call_p", _internals.pallas_call_primitive())}
    if _routes_via_mpmd:
        nets["mpmd_map"] = ("pl.kernel/core_map (mpmd_map)", "mpmd_map_p", _internals.mpmd_map_primitive())
    registry = _internals.lowering_registry()
    if registry is None:
        _internals.note_missing("jax.interpreters.mlir registries", "the CPU lowering net is not installed")
    for net, (entry_point, name, primitive) in nets.items():
        if registry is not None and primitive is None:
            _internals.note_missing(name, f"the CPU lowering net for {entry_point} is not installed")
        installed = None
        if registry is not None and primitive is not None:
            installed = _lowering.install_rule(registry, primitive, entry_point)
        if installed is None:
            _net_gaps[net] = (
                f"the CPU lowering net for {entry_point} is not installed (JAX internals not found in "
                f"jax {_internals.jax_version()}: {', '.join(sorted(_internals.missing))})"
            )
        else:
            _rules.append(installed)


def _on_import(module: ModuleType) -> None:
    """Post-import callback: patch the entry points of ``module``. Never raises into an import."""
    global _failure  # noqa: PLW0603
    with _lock:
        if not _requested or _failure is not None:
            return
        try:
            if module.__name__ == PALLAS_MODULE:
                from ._internals import check_tested_range

                check_tested_range()
            for attribute, entry_point in _ENTRY_POINTS.get(module.__name__, ()):
                _wrap_entry_point(module, attribute, entry_point)
            _install_lowering_net()
        except Exception as error:  # the user's import must not fail because of us
            _failure = f"{type(error).__name__}: {error}"
            _undo_locked()
            sys.stderr.write(
                f"pallas_guard: disabled itself after an internal error while patching {module.__name__}: {_failure}\n"
            )


def _undo_locked() -> None:
    _state.set_active(False)
    while _patches:
        _patches.pop().restore()
    while _rules:
        _rules.pop().remove()
    _net_gaps.clear()


def install(
    policy: _policy.Policy | str | None = None, *, interpreter: _policy.Interpreter | str | None = None
) -> None:
    """Install the guard (idempotent). Settings not given come from the ``PALLAS_GUARD_*`` variables.

    Raises ``PallasGuardConfigError`` (a ``ValueError``) for a bad variable or argument value and
    ``TypeError`` for an argument of the wrong type, before changing anything.
    """
    global _requested, _failure  # noqa: PLW0603
    parsed_policy = None if policy is None else _policy.parse_policy(policy, source="install(policy=...)")
    parsed_interpreter = (
        None if interpreter is None else _policy.parse_interpreter(interpreter, source="install(interpreter=...)")
    )
    with _lock:
        _policy.load_from_env()
        if parsed_policy is not None:
            _policy.set_process_policy(parsed_policy, "install(policy=...)")
        if parsed_interpreter is not None:
            _policy.set_process_interpreter(parsed_interpreter, "install(interpreter=...)")
        _requested = True
        _failure = None
        _state.set_active(True)
    finder = _hook.finder()
    for module_name in _ENTRY_POINTS:
        finder.register(module_name, _on_import)


def uninstall() -> None:
    """Remove the guard (idempotent): the original functions and lowering registries come back."""
    global _requested  # noqa: PLW0603
    with _lock:
        _requested = False
        _undo_locked()


def status() -> dict[str, Any]:
    """For ``doctor`` and tests: what is installed right now."""
    with _lock:
        return {
            "requested": _requested,
            "active": _state.active(),
            "failure": _failure,
            "patched": [f"{p.owner.__name__}.{p.attribute}" for p in _patches],
            "lowering_rules": [str(r.primitive) for r in _rules],
            "lowering_net_gaps": dict(_net_gaps),
        }
