"""Kernel facts, call sites, and the one message builder behind every warning and error."""

from __future__ import annotations

import functools
import os
import re
import sys
import types
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from pallas_guard_autoload import DETECT_RACES_ENV, INTERPRETER_ENV, POLICY_ENV

from . import _interpreters
from ._enums import Policy
from ._errors import PallasGuardError, PallasGuardWarning
from ._settings import Setting
from ._target import Target, accelerator_evidence


class KernelInfo(NamedTuple):
    name: str
    defined_at: str | None
    entry_point: str


def _code_location(function: Any) -> str | None:
    code = getattr(function, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def kernel_from_callable(kernel: object, *, entry_point: str, name: object = None) -> KernelInfo:
    """Facts about a kernel body the user handed to an entry point (partials unwrapped)."""
    function = kernel
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__wrapped__", function)
    label = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if isinstance(name, str) and name:
        label = f"{name} ({label})" if label and label != name else name
    return KernelInfo(str(label or "<unnamed kernel>"), _code_location(function), entry_point)


_SRC_INFO = re.compile(r"^(?P<name>.*?) at (?P<location>.+:\d+)$")


def kernel_from_params(params: Mapping[str, Any], *, entry_point: str) -> KernelInfo:
    """Facts about a kernel from its equation's parameters (the lowering net's only source)."""
    jaxpr = params.get("jaxpr")
    if jaxpr is None and params.get("jaxprs"):
        jaxpr = params["jaxprs"][0]
    debug_info = getattr(jaxpr, "debug_info", None) or getattr(getattr(jaxpr, "jaxpr", None), "debug_info", None)
    src_info = str(getattr(debug_info, "func_src_info", "") or "")
    match = _SRC_INFO.match(src_info)
    label, location = (match["name"], match["location"]) if match else (None, None)
    name = params.get("name")
    if name_and_src := params.get("name_and_src_info"):
        name = getattr(name_and_src, "name", name)
    if isinstance(name, str) and name:
        label = f"{name} ({label})" if label and label != name else name
    return KernelInfo(label or "<unnamed kernel>", location, entry_point)


# --- call sites ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _internal_prefixes() -> tuple[str, ...]:
    prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for name in ("jax", "jaxlib", "wrapt"):
        module = sys.modules.get(name)
        module_file = getattr(module, "__file__", None)
        if module_file:
            prefixes.append(os.path.dirname(os.path.abspath(module_file)) + os.sep)
    return tuple(prefixes)


def user_call_site() -> str | None:
    """``file:line`` of the innermost frame that is not jax, jaxlib, wrapt or pallas_guard."""
    prefixes = _internal_prefixes()
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - cheaper than inspect.stack(), which reads source files
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(prefixes) and not filename.startswith("<frozen"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


# --- messages -----------------------------------------------------------------------------------


def _describe(kernel: KernelInfo, call_site: str | None) -> str:
    defined = f" (defined at {kernel.defined_at})" if kernel.defined_at else ""
    called = f", called at {call_site}," if call_site else ""
    return f"Pallas kernel {kernel.name!r}{defined}{called} via {kernel.entry_point}"


def message(
    *,
    refused: bool,
    kernel: KernelInfo,
    call_site: str | None,
    target: Target,
    policy: Setting[Policy],
    interpreter: str | None = None,
    failure: str | None = None,
    race: bool = False,
    why_interpreter: str | None = None,
) -> str:
    """The one message builder: what happened, why the target is the CPU, how to change it.

    Variants: refused (strict), interpreted (warn), ``failure`` (the chosen interpreter cannot run
    the kernel on the CPU, and why) and ``race`` (TPU interpret mode's race detector fired).
    """
    what = _describe(kernel, call_site)
    tried = _interpreters.describe_interpreter(interpreter or "plain")
    if race:
        head = (
            f"pallas_guard: a data race was detected in {what}, run in {tried} with race detection "
            f"({DETECT_RACES_ENV}=1); the detector's RACE DETECTED report above names the buffers."
        )
        return "\n".join([head, f"To run without race detection: unset {DETECT_RACES_ENV}."])
    if failure is not None:
        chosen = f" (chosen because: {why_interpreter})" if why_interpreter else ""
        lines = [
            f"pallas_guard: {what} cannot run on the CPU: the guard tried {tried}{chosen}, and {failure}.",
            "Why the target is the CPU: " + "; ".join(target.evidence) + ".",
            *accelerator_evidence(),
            f"To fix: run it where a GPU/TPU backend is available; or force another interpreter with "
            f"{INTERPRETER_ENV}=plain|tpu|gpu (auto chooses per kernel); or set {POLICY_ENV}=strict "
            "to fail before tracing.",
        ]
        return "\n".join(lines)
    if refused:
        head = (
            f"pallas_guard: {what} would lower for the CPU without interpret=, where JAX supports "
            "only interpret mode (policy 'strict')."
        )
    else:
        head = (
            f"pallas_guard: {what} is lowering for the CPU, so it runs with the "
            f"{interpreter or 'plain'} interpreter (policy 'warn')."
        )
    lines = [head, "Why the target is the CPU: " + "; ".join(target.evidence) + "."]
    lines.extend(accelerator_evidence())
    lines.append(f"Policy {policy.value.value!r} came from {policy.source}.")
    if refused:
        lines.append(
            f"To fix: set {POLICY_ENV}=interpret (or warn) to run it interpreted; or pass "
            "interpret=True to the kernel yourself; or run where a GPU/TPU backend is available."
        )
    else:
        lines.append(
            f"To silence: {POLICY_ENV}=interpret; to fail instead: {POLICY_ENV}=strict; or pass interpret= yourself."
        )
    return "\n".join(lines)


def refusal(*, kernel: KernelInfo, call_site: str | None, target: Target, policy: Setting[Policy]) -> PallasGuardError:
    return PallasGuardError(message(refused=True, kernel=kernel, call_site=call_site, target=target, policy=policy))


def interpreter_failure(
    error: BaseException,
    *,
    kernel: KernelInfo,
    call_site: str | None,
    target: Target,
    policy: Setting[Policy],
    interpreter: str,
    family: str | None,
    why: str | None = None,
) -> PallasGuardError | None:
    """A ``PallasGuardError`` explaining ``error`` when the CPU or the interpreter caused it, else None
    (then the caller re-raises ``error`` untouched: the kernel's own bugs are not hidden)."""
    failure = _interpreters.explain_failure(error, interpreter=interpreter, family=family)
    if failure is None:
        return None
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=target,
        policy=policy,
        interpreter=interpreter,
        failure=failure,
        why_interpreter=why,
    )
    return PallasGuardError(f"{text}\nOriginal error: {type(error).__name__}: {error}")


def race_error(*, kernel: KernelInfo, call_site: str | None) -> PallasGuardError:
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=Target("cpu", ()),
        policy=Setting(Policy.INTERPRET, "race detection"),
        interpreter="tpu",
        race=True,
    )
    return PallasGuardError(text)


def check_races(out: Any, *, kernel: KernelInfo, call_site: str | None) -> None:
    """Raise ``PallasGuardError`` naming ``kernel`` if TPU interpret mode found a race running it.

    Run eagerly, the kernel has finished when this returns and the error is raised here; traced
    (under jit), a callback that depends on the kernel's output checks after it ran, and its error
    surfaces from the jitted call, wrapped by JAX's runtime error.
    """
    import jax

    from . import _internals

    def raise_if_race(*_: Any) -> None:
        if _internals.races_found():
            raise race_error(kernel=kernel, call_site=call_site)

    leaves = jax.tree_util.tree_leaves(out)
    if not leaves:
        return
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        jax.debug.callback(raise_if_race, leaves[0])
        return
    jax.block_until_ready(out)  # type: ignore[no-untyped-call]
    raise_if_race()


# One registry per file, as Python keeps one per module: with it the "default" action shows a
# warning once per location; "error"/"always" see every one, and a filter change (pytest does one
# per test) resets it. The guard keeps no once-only memory of its own.
_registries: dict[str, dict[Any, Any]] = {}


def warn(
    *, kernel: KernelInfo, call_site: str | None, target: Target, policy: Setting[Policy], interpreter: str
) -> bool:
    """Emit a ``PallasGuardWarning`` attributed to the user's line; repetition is the filters' business."""
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=target,
        policy=policy,
        interpreter=interpreter,
    )
    filename, _, line = (call_site or "").rpartition(":")
    if filename and line.isdigit():
        # warn_explicit puts the warning on the user's line even from inside a lowering rule,
        # where no stacklevel could reach it.
        registry = _registries.setdefault(filename, {})
        warnings.warn_explicit(text, PallasGuardWarning, filename, int(line), registry=registry)
    else:
        warnings.warn(text, PallasGuardWarning, stacklevel=2)
    return True
