"""The ``lowering`` check: a kernel the guard interprets is also lowered for its real target.

A kernel that runs interpreted on a CPU can still be refused by the target it was written for:
JAX's own Python lowering for TPU (Mosaic) and GPU (Triton, Mosaic GPU) refuses block shapes,
primitives and array sizes the interpreters accept. That lowering ships in jaxlib and runs on any
machine given a target platform and, for a GPU, an abstract device; the check runs it once per
kernel identity and shapes, on the kernel's ``pallas_call`` alone (as the user built it), for the
platform of the device setting or, without one, the kernel family's own (with a default device).
What only the hardware compiler sees (Mosaic's passes in libtpu, ptxas) stays out of reach.

A refusal is a finding. A failure that is not the kernel's (this jaxlib lacks the lowering, no GPU
device can be presented) is a note: the check could not run.
"""

from __future__ import annotations

import contextvars
import inspect
import linecache
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import device as _device
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import source as jax_source
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._vocabulary import settings as _settings
from pallas_guard_autoload import DEVICES, device_list

if TYPE_CHECKING:
    from pallas_guard._guard.engine import Run

DEFAULT_DEVICES = {"mosaic_tpu": "tpu-v5e", "triton": "h100", "mosaic_gpu": "h100"}
"""The device a kernel family is lowered for when no device is set."""

_PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}
"""A device's platform (``DEVICES``) -> the platform JAX's lowering is asked for."""

_NOT_THE_KERNELS = (
    "No supported GPU devices found",  # no abstract device reached the GPU lowering
    "AbstractDevice",
    "jaxlib",  # "... install jaxlib with GPU support" and the like: this jaxlib lacks the lowering
    "libtpu",
    # A Mosaic-GPU kernel's lowering compiles for the backend of this process (the CPU) on the way:
    # JAX's own GPU lowering cannot run here, whatever the kernel.
    "is different from the lowering platform",
)
"""Words of lowering errors that say the check could not run, not that the kernel was refused."""


class Target(NamedTuple):
    platform: str
    """JAX's name for the platform lowered for (``tpu``, ``cuda``)."""
    device: str
    """The device short name whose abstract device is presented while lowering."""
    source: str
    """Where the device came from (the setting, or the family's default)."""

    def describe(self) -> str:
        return f"{self.platform} ({DEVICES[self.device][0]}, {self.source})"


class Outcome(NamedTuple):
    note: str
    """What the decision says: lowered for what, or why the check could not run."""
    refused: BaseException | None = None
    """JAX's lowering error where the target refused the kernel."""
    target: Target | None = None
    unchecked: str | None = None
    """Why the check could not run, where it could not."""


_FAMILY_PLATFORMS = {"mosaic_tpu": "tpu", "triton": "gpu", "mosaic_gpu": "gpu"}
"""The platform (``DEVICES``) a kernel family is written for."""


def target_for(family: str | None, setting: str | None) -> Target | str:
    """The target to lower for: the device setting's first device of the kernel family's platform
    (the first of all for a generic kernel), else the family's default device (Mosaic TPU: a TPU
    v5e; Triton, Mosaic GPU: an H100), so that a project with both families sets one device (or one
    per family) and no valid kernel is refused for the other family's; a reason to skip where
    neither tells."""
    platform = _FAMILY_PLATFORMS.get(family or "")
    devices = device_list(setting)
    for device in devices:
        if platform in (None, DEVICES[device][2]):
            return Target(_PLATFORMS[DEVICES[device][2]], device, "the device setting")
    if family in DEFAULT_DEVICES:
        default = DEFAULT_DEVICES[family]
        source = f"the default for {family} kernels"
        if devices:
            named = " and ".join(repr(device) for device in devices)
            source += f"; the device setting {named} names no {DEVICES[default][2].upper()}"
        return Target(_PLATFORMS[DEVICES[default][2]], default, source)
    return "a generic kernel has no target of its own: set a device (PALLAS_GUARD_DEVICE) to lower it for one"


def shapes_of(tree: Any) -> Any:
    """Arrays and tracers as their shapes and dtypes: the kernel lowers without values."""
    import jax

    shaped: Any = jax.ShapeDtypeStruct

    def aval(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return shaped(leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False))
        return leaf

    return jax.tree_util.tree_map(aval, tree)


def lowering_api() -> str | None:
    """Why this jax cannot lower for a platform of choice, or None where it can
    (``jax.jit(f).trace(...).lower(lowering_platforms=...)``)."""
    import jax

    traced = getattr(getattr(jax, "stages", None), "Traced", None)
    lower = getattr(traced, "lower", None)
    try:
        takes = lower is not None and "lowering_platforms" in inspect.signature(lower).parameters
    except (TypeError, ValueError):
        takes = False
    return None if takes else f"jax {jax_lookup.jax_version()} cannot lower a traced function for a chosen platform"


_as_the_target: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_guard_as_the_target", default=False)


def hook(hooks: list[Any]) -> None:
    """While the check lowers, Mosaic serialises for the IR version a current TPU reads, not the
    older one JAX falls back to where no TPU backend is initialised (a matmul option it cannot
    express would be refused there, and only there); the entry added to ``hooks`` puts it back."""
    from pallas_guard._vocabulary.patch import wrap

    def current_version(get_ir_version: Callable[..., Any]) -> Callable[..., Any]:
        def pallas_guard_ir_version(*args: Any, **kwargs: Any) -> Any:
            return None if _as_the_target.get() else get_ir_version(*args, **kwargs)

        pallas_guard_ir_version.pallas_guard_lowering = True  # type: ignore[attr-defined]
        return pallas_guard_ir_version

    module = jax_lookup.import_optional("jax._src.tpu_custom_call")
    wrap(module, "get_ir_version", current_version, hooks, is_ours=lambda f: hasattr(f, "pallas_guard_lowering"))


def check(
    build: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any], target: Target, hooks: list[Any]
) -> Outcome:
    """Lower the kernel ``build`` returns, called with the shapes of ``args``/``kwargs``, for
    ``target``, with its abstract device presented (``hooks``: the installation's, which puts back
    what the lowering wraps)."""
    import jax

    missing = lowering_api()
    if missing is not None:
        return Outcome(f"lowering: not checked: {missing}", unchecked=missing)
    avals, kwavals = shapes_of((args, kwargs))
    hook(hooks)
    token = _as_the_target.set(True)
    try:
        with _device.presented(target.device), jax_tracing.retrace_logs_muted():
            jax.jit(build()).trace(*avals, **kwavals).lower(lowering_platforms=(target.platform,))
    except (MemoryError, RecursionError):
        raise
    except Exception as error:
        first = _diagnostics.first_line(error)
        if isinstance(error, ImportError) or any(words in first for words in _NOT_THE_KERNELS):
            why = f"for {target.describe()}: {first}"
            return Outcome(f"lowering: not checked {why}", unchecked=why)
        return Outcome(f"lowering: refused by {target.describe()}", refused=error, target=target)
    finally:
        _as_the_target.reset(token)
    return Outcome(f"lowering: lowers for {target.describe()}")


_UNSUPPORTED = re.compile(r"Unimplemented primitive in Pallas \w+ lowering(?: for [\w.]+)?: (\w+)")


def unsupported_primitive_fix(
    build: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any], error: BaseException
) -> str | None:
    """Where a primitive the target has no rule for is used in the kernel: the line to change (the
    kernel is traced again for it, only when refused)."""
    import jax

    match = _UNSUPPORTED.search(str(error))
    if match is None:
        return None
    primitive = match.group(1)
    avals, kwavals = shapes_of((args, kwargs))
    try:
        traced = jax.make_jaxpr(build())(*avals, **kwavals)
    except Exception:  # no line to name: the refusal stands without one
        return None
    site = _site_of(traced.jaxpr, primitive, None)
    if site is None:
        return None
    filename, line, _ = site
    code = linecache.getline(filename, line).strip()
    return f"{primitive} has no lowering for this target: replace it at {filename}:{line}" + (
        f" (`{code}`)" if code else ""
    )


def _site_of(jaxpr: Any, primitive: str, outer: tuple[str, int, str] | None) -> tuple[str, int, str] | None:
    """The kernel line of the first use of ``primitive``: its equation's, or, inside a helper JAX
    traced (``jnp.sort`` is a jit of its own), the line that called the helper."""
    for eqn in getattr(getattr(jaxpr, "jaxpr", jaxpr), "eqns", ()):
        site = jax_source.access_site(eqn) or outer
        if eqn.primitive.name == primitive:
            return site
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    found = _site_of(inner, primitive, site)
                    if found is not None:
                        return found
    return None


class Lowering(_checks.Check):
    name = "lowering"
    order = 0
    at_front_door = True

    def before(self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared:
        """Lower the kernel as the user built it for its real target; a refusal is a finding."""
        __tracebackhide__ = True
        target = target_for(run.kernel.facts.family, _settings.current("device").value)
        if isinstance(target, str):
            return _checks.Prepared(
                _checks.unchecked(self.name, target, kernel=run.kernel.info, call_site=run.call_site)
            )
        if run.kernel.entry.runs_when_applied:  # core_map runs its body when built: nothing to lower
            why = f"{run.kernel.entry.label} runs when built"
            return _checks.Prepared(_checks.unchecked(self.name, why, kernel=run.kernel.info, call_site=run.call_site))
        outcome = check(run.kernel.build, args, kwargs, target, run.hooks)
        if outcome.unchecked is not None:
            _checks.unchecked(self.name, outcome.unchecked, kernel=run.kernel.info, call_site=run.call_site)
        if outcome.refused is not None:
            error = _diagnostics.lowering_refused(
                kernel=run.kernel.info,
                call_site=run.call_site,
                target=target.describe(),
                error=outcome.refused,
                source=_settings.stated("checks"),
                fix=unsupported_primitive_fix(run.kernel.build, args, kwargs, outcome.refused),
            )
            raise _checks.found(self.name, error, kernel=run.kernel.info, call_site=run.call_site) from None
        return _checks.Prepared(outcome.note)


CHECK = Lowering()
