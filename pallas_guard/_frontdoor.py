"""The front door: wrappers on the public entry points that build Pallas kernels.

The decision is taken when the entry point is called (``pl.pallas_call(kernel, ...)``), which is
trace time for the usual inline use. Only what must happen at trace time happens here: refusing
under ``strict`` before the body is traced, and choosing the TPU or Mosaic-GPU interpreter, which
add effects while tracing. The plain interpreter is left to the lowering net, which knows the real
target: an AOT lowering or export for cuda/tpu from this process stays byte-identical.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

from . import _decide, _diagnostics, _internals, _interpreters, _record, _settings, _state, _target
from ._enums import Policy
from ._errors import PallasGuardError

# The parameter that holds the kernel body, per entry point.
_BODY_PARAMETER = {"pallas_call": "kernel", "pl.kernel": "body", "plgpu.kernel": "body", "pl.core_map": None}


def _kernel_info(entry_point: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _diagnostics.KernelInfo:
    parameter = _BODY_PARAMETER.get(entry_point)
    body = args[0] if args and parameter else kwargs.get(parameter or "")
    if body is None or not callable(body):
        name = kwargs.get("name") or f"<{entry_point} body>"
        return _diagnostics.KernelInfo(str(name), None, entry_point)
    return _diagnostics.kernel_from_callable(body, entry_point=entry_point, name=kwargs.get("name"))


def _strict_fallback(
    entry_point: str, verdict: _decide.Verdict, choice: _interpreters.Choice | None, installation: Any
) -> tuple[_decide.Verdict, _target.Target, _settings.Setting[Policy]] | None:
    """Where the lowering net is missing, what would be left to it is refused here instead.

    Deferring to a net that is not there would be the guard silently doing nothing. An unknown
    target is taken to be the CPU only when no accelerator plugin is installed (so JAX can only
    use the CPU); otherwise the kernel is left to JAX, which may well run it on its accelerator.
    """
    gap = installation.lowering_net_gap(entry_point)
    if gap is None:
        return None
    if verdict.action is _decide.Action.DEFER:
        if _target.installed_accelerator_plugins():
            return None
        target = _target.Target("cpu", ("the target is not configured and no accelerator plugin is installed",))
    elif verdict.action is _decide.Action.INTERPRET and choice is not None and choice.value is None:
        target = _target.detect()  # plain, which only the net could have substituted
    else:
        return None
    policy = _settings.current_policy()
    reason = f"falls back to strict: {gap}"
    strict = _settings.Setting(
        Policy.STRICT,
        f"pallas_guard's fallback: {gap}, and policy {policy.value.value!r} (from {policy.source}) needs it; "
        "pass interpret=True yourself, or use a jax version pallas_guard supports",
    )
    return _decide.Verdict(_decide.Action.REFUSE, False, reason), target, strict


def _body(entry_point: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    parameter = _BODY_PARAMETER.get(entry_point)
    if not parameter:
        return None
    return args[0] if args else kwargs.get(parameter)


def _kernel_facts(entry_point: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _interpreters.KernelFacts:
    mesh = args[0] if entry_point == "pl.core_map" and args else None
    return _interpreters.kernel_facts(entry_point, _body(entry_point, args, kwargs), kwargs, mesh=mesh)


class _Guarded:
    """What the front door knows about one interpreted kernel, to explain its failures and races."""

    def __init__(
        self,
        *,
        entry_point: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        choice: _interpreters.Choice,
        facts: _interpreters.KernelFacts,
        target: _target.Target,
        policy: _settings.Setting[Policy],
    ) -> None:
        self._entry_point, self._args, self._kwargs = entry_point, args, kwargs
        self.choice, self.facts, self.target, self.policy = choice, facts, target, policy

    # Only read when something is injected, warned, recorded or explained: the plain-interpreter
    # path (the common one) does no stack walk for them.
    @functools.cached_property
    def kernel(self) -> _diagnostics.KernelInfo:
        return _kernel_info(self._entry_point, self._args, self._kwargs)

    @functools.cached_property
    def call_site(self) -> str | None:
        return _diagnostics.user_call_site()

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``function``; a failure the guard can attribute to the CPU becomes PallasGuardError."""
        try:
            return function(*args, **kwargs)
        except PallasGuardError:
            raise
        except Exception as error:
            failure = _diagnostics.interpreter_failure(
                error,
                kernel=self.kernel,
                call_site=self.call_site,
                target=self.target,
                policy=self.policy,
                interpreter=self.choice.name,
                family=self.facts.family,
                why=self.choice.reason,
            )
            if failure is None:
                raise
            raise failure from error

    def wrap_kernel(self, kernel_callable: Any) -> Any:
        """The callable an entry point returned, with failures explained and races checked.

        A wrapt proxy, not a plain function: what JAX returned keeps its attributes
        (``.lower``, ``.trace`` of a jitted kernel) and its identity-free behaviour otherwise.
        """
        if not callable(kernel_callable):
            return kernel_callable

        def pallas_guard_kernel(
            wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            del instance
            out = self.run(wrapped, *args, **kwargs)
            if self.choice.detect_races:
                _diagnostics.check_races(out, kernel=self.kernel, call_site=self.call_site)
            return out

        return _kernel_wrapper_class()(kernel_callable, pallas_guard_kernel)


def wrap_entry_point(original: Callable[..., Any], entry_point: str, installation: Any) -> Any:
    """The wrapper that replaces ``original``; it acts only while ``installation`` is active."""

    def pallas_guard_front_door(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        interpret = kwargs.get("interpret", False)
        if interpret:
            return wrapped(*args, **kwargs)
        policy = _settings.current_policy()
        if policy.value is Policy.OFF:
            return wrapped(*args, **kwargs)
        target = _target.detect()
        verdict = _decide.decide(
            policy=policy.value,
            platform=target.platform,
            interpret=interpret,
            forced_by_jax=_internals.forced_interpret_value(),
        )
        facts = choice = None
        if verdict.action is _decide.Action.INTERPRET:
            facts = _kernel_facts(entry_point, args, kwargs)
            choice = _interpreters.choose(
                _settings.current_interpreter(),
                facts,
                detect_races=_settings.detect_races(),
                inside_lowering=_internals.inside_lowering(),
            )
        shown_policy = policy
        fallback = _strict_fallback(entry_point, verdict, choice, installation)
        if fallback is not None:
            verdict, target, shown_policy = fallback
        if verdict.action is _decide.Action.REFUSE:
            if _target.inside_export():
                return wrapped(*args, **kwargs)  # the export's platforms decide, at lowering
            kernel = _kernel_info(entry_point, args, kwargs)
            call_site = _diagnostics.user_call_site()
            _record.note(
                kernel,
                called_at=call_site,
                platforms=(target.platform or "?",),
                policy=policy.value,
                action="refused",
                interpreter=None,
                reason=verdict.reason,
                layer="front door",
            )
            raise _diagnostics.refusal(kernel=kernel, call_site=call_site, target=target, policy=shown_policy)
        if verdict.action is _decide.Action.INTERPRET and choice is not None and facts is not None:
            guarded = _Guarded(
                entry_point=entry_point,
                args=args,
                kwargs=kwargs,
                choice=choice,
                facts=facts,
                target=target,
                policy=policy,
            )
            if choice.value is not None and not _target.inside_export():
                kernel, call_site = guarded.kernel, guarded.call_site
                warned = verdict.warn and _diagnostics.warn(
                    kernel=kernel, call_site=call_site, target=target, policy=policy, interpreter=choice.name
                )
                _state.mark_injected(choice.value)
                _record.note(
                    kernel,
                    called_at=call_site,
                    platforms=(target.platform or "?",),
                    policy=policy.value,
                    action="interpreted",
                    interpreter=choice.name,
                    reason=f"{verdict.reason}; {choice.reason}",
                    layer="front door",
                    warned=warned,
                )
                kwargs = {**kwargs, "interpret": choice.value}
            result = guarded.run(wrapped, *args, **kwargs)
            # The kernel callable (tracing the body, eager runs); decorator forms are left alone.
            body_given = entry_point != "pl.core_map" and callable(_body(entry_point, args, kwargs))
            if entry_point == "pallas_call" or body_given:
                return guarded.wrap_kernel(result)
            return result
        return wrapped(*args, **kwargs)

    pallas_guard_front_door.__qualname__ = f"pallas_guard_front_door[{entry_point}]"
    wrapper = _entry_point_wrapper_class()(original, pallas_guard_front_door, installation.is_active)
    # wrapt keeps `_self_`-prefixed attributes on the proxy itself: our marker for idempotence.
    wrapper._self_pallas_guard = True  # noqa: SLF001
    return wrapper


@functools.cache
def _entry_point_wrapper_class() -> type:
    import wrapt

    class EntryPointWrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
        """An entry point with the guard in front; pickles by reference, as the function it wraps."""

        def __reduce_ex__(self, protocol: object) -> str:
            # A name: pickle stores module + qualified name, as for the function itself, and loads
            # whatever that name holds there (this wrapper while the guard is installed).
            return str(self.__wrapped__.__qualname__)

    return EntryPointWrapper


@functools.cache
def _kernel_wrapper_class() -> type:
    import wrapt

    class KernelWrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
        """The callable an entry point returned, with failures explained; pickles as that callable."""

        def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
            # itemgetter(0)((x,)) is x: the wrapped callable is pickled (by value or by reference,
            # as pickle or cloudpickle would without the guard) and nothing of pallas_guard is needed
            # to load it.
            return operator.itemgetter(0), ((self.__wrapped__,),)

    return KernelWrapper
