"""The front door: wrappers on the public entry points that build Pallas kernels.

The decision is taken when the entry point is called (``pl.pallas_call(kernel, ...)``), which is
trace time for the usual inline use. Only what must happen at trace time happens here: refusing
under ``strict`` before the body is traced, and choosing the TPU or Mosaic-GPU interpreter, which
add effects while tracing. The plain interpreter is left to the lowering net, which knows the real
target: an AOT lowering or export for cuda/tpu from this process stays byte-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _decide, _diagnostics, _internals, _interpreters, _policy, _record, _state, _target

# The parameter that holds the kernel body, per entry point.
_BODY_PARAMETER = {"pallas_call": "kernel", "pl.kernel": "body", "plgpu.kernel": "body", "pl.core_map": None}


def _kernel_info(entry_point: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _diagnostics.KernelInfo:
    parameter = _BODY_PARAMETER.get(entry_point)
    body = args[0] if args and parameter else kwargs.get(parameter or "")
    if body is None or not callable(body):
        name = kwargs.get("name") or f"<{entry_point} body>"
        return _diagnostics.KernelInfo(str(name), None, entry_point)
    return _diagnostics.kernel_from_callable(body, entry_point=entry_point, name=kwargs.get("name"))


def make_wrapper(entry_point: str) -> Callable[..., Any]:
    """The wrapt wrapper function for one entry point."""

    def pallas_guard_front_door(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        interpret = kwargs.get("interpret", False)
        if interpret or not _state.active():
            return wrapped(*args, **kwargs)
        policy = _policy.current_policy()
        if policy.value is _policy.Policy.OFF:
            return wrapped(*args, **kwargs)
        target = _target.detect()
        verdict = _decide.decide(
            policy=policy.value,
            platform=target.platform,
            interpret=interpret,
            forced_by_jax=_internals.forced_interpret_value(),
        )
        if verdict.action is _decide.Action.REFUSE:
            if _target.inside_export():
                return wrapped(*args, **kwargs)  # the export's platforms decide, at lowering
            kernel = _kernel_info(entry_point, args, kwargs)
            call_site = _diagnostics.user_call_site()
            _record.add(
                _record.Decision(
                    kernel=kernel.name,
                    defined_at=kernel.defined_at,
                    called_at=call_site,
                    platforms=(target.platform or "?",),
                    policy=policy.value,
                    action="refused",
                    interpreter=None,
                    reason=verdict.reason,
                    layer="front door",
                    entry_point=entry_point,
                )
            )
            raise _diagnostics.refusal(kernel=kernel, call_site=call_site, target=target, policy=policy)
        if verdict.action is _decide.Action.INTERPRET:
            choice = _interpreters.choose(_policy.current_interpreter(), kwargs)
            if choice.value is not None and not _target.inside_export():
                kernel = _kernel_info(entry_point, args, kwargs)
                call_site = _diagnostics.user_call_site()
                warned = verdict.warn and _diagnostics.warn_once(
                    kernel=kernel, call_site=call_site, target=target, policy=policy, interpreter=choice.name
                )
                _state.mark_injected(choice.value)
                _record.add(
                    _record.Decision(
                        kernel=kernel.name,
                        defined_at=kernel.defined_at,
                        called_at=call_site,
                        platforms=(target.platform or "?",),
                        policy=policy.value,
                        action="interpreted",
                        interpreter=choice.name,
                        reason=f"{verdict.reason}; {choice.reason}",
                        layer="front door",
                        warned=warned,
                        entry_point=entry_point,
                    )
                )
                kwargs = {**kwargs, "interpret": choice.value}
        return wrapped(*args, **kwargs)

    pallas_guard_front_door.__qualname__ = f"pallas_guard_front_door[{entry_point}]"
    return pallas_guard_front_door
