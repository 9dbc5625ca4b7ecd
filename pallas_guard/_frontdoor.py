"""The front door: wrappers on the entry points that build Pallas kernels (``_entry_points``).

A thin adapter: it gathers the situation when an entry point is called (trace time for the usual
inline use), asks ``_plan`` what to do, and has ``_act`` carry it out. Only what must happen at
trace time happens here: refusing under ``strict`` before the body is traced, and choosing the TPU
or Mosaic-GPU interpreter, which add effects while tracing; where a kernel's facts leave the choice
open, the first call verifies the candidates (a trial lowering of the kernel alone for the CPU)
and falls back to the next one that can run it. The plain interpreter is left to the lowering net,
which knows the real target: an AOT lowering or export for cuda/tpu stays byte-identical.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable
from typing import Any

from . import _act, _diagnostics, _internals, _interpreters, _plan, _settings, _state, _target
from ._entry_points import EntryPoint
from ._enums import Policy
from ._errors import PallasGuardError


class _KernelCall:
    """One call of an entry point; what the guard learns of the kernel is computed on demand."""

    def __init__(self, entry: EntryPoint, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.entry, self.args, self.kwargs = entry, args, kwargs

    decorated: Any = None
    """The body a decorator form (``@pl.kernel(mesh=...)``) was applied to, once it was."""

    @property
    def body(self) -> Any:
        return self.decorated if self.decorated is not None else self.entry.body(self.args, self.kwargs)

    @functools.cached_property
    def grid(self) -> tuple[Any, ...] | None:
        grid = self.kwargs.get("grid")
        if grid is None:
            grid = getattr(self.kwargs.get("grid_spec"), "grid", None)
        return (grid,) if isinstance(grid, int) else tuple(grid) if grid is not None else None

    def given_body(self, body: Any) -> None:
        """A decorator form received its body: diagnostics name it, rebuilds apply to it."""
        self.decorated = body
        self.__dict__.pop("info", None)

    @functools.cached_property
    def info(self) -> _diagnostics.KernelInfo:
        if self.body is None:
            name = self.kwargs.get("name") or f"<{self.entry.label} body>"
            return _diagnostics.KernelInfo(str(name), None, self.entry.label)
        return _diagnostics.kernel_from_callable(self.body, entry_point=self.entry.label, name=self.kwargs.get("name"))

    @functools.cached_property
    def facts(self) -> _interpreters.KernelFacts:
        mesh = self.entry.mesh(self.args, self.kwargs)
        return _interpreters.kernel_facts(self.entry.label, self.body, self.kwargs, mesh=mesh)

    def candidates(self) -> _interpreters.Candidates:
        checks = _settings.current("checks")
        chosen = _interpreters.candidates(
            _settings.current_interpreter(),
            self.facts,
            checks=frozenset(checks.value),
            checks_from=checks.source,
            inside_lowering=_internals.inside_lowering(),
        )
        # An interpreter this jax lacks is no candidate.
        names = tuple(name for name in chosen.names if _interpreters.available(name)) or ("plain",)
        lacking = names != chosen.names
        return chosen._replace(names=names, verify=chosen.verify and len(names) > 1, lacking=lacking)


# --- verified choices, per kernel ------------------------------------------------------------------

_settled_lock = threading.Lock()
_settled: dict[tuple[Any, ...], tuple[str, tuple[str, ...]]] = {}
"""(entry point, kernel code, candidates, argument shapes) -> (interpreter, what was tried)."""
_MAX_SETTLED = 4096


def _shape_key(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> tuple[Any, ...]:
    import jax

    leaves = jax.tree_util.tree_leaves((call_args, call_kwargs))
    return tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


def _trial_lowering(
    kernel_callable: Callable[..., Any], call_args: tuple[Any, ...], call_kwargs: dict[str, Any]
) -> None:
    """Lower the kernel alone for the CPU (the configured target) with these argument shapes."""
    import jax

    def spec(x: Any) -> Any:
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            return x
        return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]

    args, kwargs = jax.tree_util.tree_map(spec, (call_args, call_kwargs))
    with _state.verification():
        jax.jit(lambda a, k: kernel_callable(*a, **k)).lower(args, kwargs)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


class _Guarded:
    """One interpreted kernel: how to build it for each candidate, which one runs it, and its
    failures explained."""

    def __init__(  # noqa: PLR0917
        self,
        call: _KernelCall,
        wrapped: Callable[..., Any],
        plan: _plan.Plan,
        target: _target.Target,
        policy: _settings.Setting[Policy],
        call_site: _diagnostics.CallSite,
    ) -> None:
        assert plan.candidates is not None
        self.call, self.wrapped, self.plan, self.target, self.policy = call, wrapped, plan, target, policy
        self.candidates = plan.candidates
        self.call_site = call_site
        self._built: dict[str, Any] = {}
        self._values: dict[str, Any] = {}
        self._settled: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()

    # --- building ----------------------------------------------------------------------------------

    def build(self, name: str, *, explicit: bool = False) -> Any:
        """What the entry point returns with interpreter ``name`` (``explicit``: plain as
        ``interpret=True``, for a trial the net stays out of; otherwise plain is left to the net)."""
        if not explicit and name in self._built:
            return self._built[name]
        value = _interpreters.params(name, self.candidates) if explicit else self.value(name)
        if value is None and explicit:
            value = True
        kwargs = _interpreters.entry_kwargs(name, self.call.facts, self.call.kwargs, value)
        built = self.run(self.wrapped, name, *self.call.args, **kwargs)
        if self.call.decorated is not None:  # a decorator form: what it returned, applied to the body
            built = built(self.call.decorated)
        if not explicit:
            self._built[name] = built
        return built

    def value(self, name: str) -> Any:
        """The ``interpret=`` value this kernel runs with in interpreter ``name`` (one object each,
        so the net recognises what the front door injected)."""
        with self._lock:
            if name not in self._values:
                self._values[name] = _interpreters.params(name, self.candidates)
            return self._values[name]

    def commit(self, name: str, tried: tuple[str, ...] = ()) -> None:
        """Carry the plan out for interpreter ``name``: warn and record here when the front door
        injects it; plain is the net's (it warns and records at lowering, with ``tried``)."""
        if self.candidates.checks_note is not None:
            _diagnostics.warn_checks(kernel=self.call.info, call_site=self.call_site, note=self.candidates.checks_note)
        value = self.value(name)
        if value is None:
            _state.note_verified(self.call.info.defined_at, tried)
            return
        _state.mark_injected(value)
        _act.carry_out(
            self.plan,
            layer="front door",
            kernel=self.call.info,
            call_site=self.call_site,
            target=self.target,
            policy=self.policy,
            interpreter=name,
            tried=tried,
        )

    def first(self) -> Any:
        """What the entry point returns to the caller: the kernel callable, or for a decorator form
        (``@pl.kernel(mesh=...)``) the decorator, which hands the body over when applied."""
        name = self.candidates.names[0]
        built = self.build(name)
        if self.call.entry.returns_kernel(self.call.args, self.call.kwargs) or not callable(built):
            if not self.candidates.verify:
                self.commit(name)
            return self.wrap_kernel(built)

        @functools.wraps(built)
        def decorator(body: Any, *args: Any, **kwargs: Any) -> Any:
            self.call.given_body(body)
            if not self.candidates.verify:
                self.commit(name)
            kernel = built(body, *args, **kwargs)
            self._built[name] = kernel  # what a rebuild for this interpreter would give
            return self.wrap_kernel(kernel)

        return decorator

    # --- choosing ----------------------------------------------------------------------------------

    def settle(self, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> str:
        """The interpreter that runs the kernel with these arguments: the first candidate whose
        trial lowering succeeds (once per kernel and shapes)."""
        shapes = _shape_key(call_args, call_kwargs)
        with self._lock:
            if shapes in self._settled:
                return self._settled[shapes]
        code = getattr(_interpreters.innermost_function(self.call.body), "__code__", None) or id(self.call.body)
        key = (self.call.entry.label, code, self.candidates.names, shapes)
        with _settled_lock:
            known = _settled.get(key)
        if known is None:
            # Named from the kernel's call, not from where it was built (a decorator form).
            self.call_site = _diagnostics.user_call_site()
            known = self._verify(call_args, call_kwargs)
            with _settled_lock:
                if len(_settled) < _MAX_SETTLED:
                    _settled[key] = known
        name, tried = known
        self.commit(name, tried)
        with self._lock:
            self._settled[shapes] = name
        return name

    def _verify(self, call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        failures: list[tuple[str, BaseException]] = []
        for name in self.candidates.names:
            try:
                _trial_lowering(self.build(name, explicit=True), call_args, call_kwargs)
            except Exception as error:
                failures.append((name, error))
                continue
            tried = (*(f"{n}: failed ({_first_line(e)})" for n, e in failures), f"{name}: ok")
            return name, tried
        if len({_first_line(error) for _, error in failures}) == 1:
            # Every interpreter failed the same way: the kernel's own error (a shape mismatch, a bad
            # index). The real call runs with the first candidate and raises it unchanged.
            return self.candidates.names[0], tuple(f"{n}: failed ({_first_line(e)})" for n, e in failures)
        raise _diagnostics.no_interpreter(
            failures, kernel=self.call.info, call_site=self.call_site, target=self.target, why=self.candidates.reason
        ) from failures[0][1]

    # --- running -----------------------------------------------------------------------------------

    def run(self, function: Callable[..., Any], interpreter: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``function``; a failure the guard can attribute to the CPU becomes PallasGuardError."""
        try:
            return function(*args, **kwargs)
        except PallasGuardError:
            raise
        except Exception as error:
            if "bounds" in self.candidates.checked and "Out-of-bounds read" in str(error):
                raise _diagnostics.bounds_error(error, kernel=self.call.info, call_site=self.call_site) from error
            failure = _diagnostics.interpreter_failure(
                error,
                kernel=self.call.info,
                call_site=self.call_site,
                target=self.target,
                policy=self.policy,
                interpreter=interpreter,
                family=self.call.facts.family,
                why=self.candidates.reason,
            )
            if failure is None:
                raise
            raise failure from error

    def wrap_kernel(self, kernel_callable: Any) -> Any:
        """The callable an entry point returned, with the choice settled on its first call,
        failures explained and races checked (a proxy: it keeps what JAX returned's attributes)."""
        if not callable(kernel_callable):
            return kernel_callable

        def pallas_guard_kernel(
            wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            del instance
            name = self.candidates.names[0]
            if self.candidates.verify:
                name = self.settle(args, kwargs)
                wrapped = self.build(name)
            out = self.run(wrapped, name, *args, **kwargs)
            if self.candidates.detect_races:
                _diagnostics.check_races(out, kernel=self.call.info, call_site=self.call_site, interpreter=name)
            return out

        return _kernel_wrapper_class()(kernel_callable, pallas_guard_kernel)


def wrap_entry_point(original: Callable[..., Any], entry: EntryPoint, installation: Any) -> Any:
    """The wrapper that replaces ``original``; it acts only while ``installation`` is active."""

    def pallas_guard_front_door(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        interpret = kwargs.get("interpret", False)
        call = _KernelCall(entry, args, kwargs)
        target = _target.detect() if not interpret else _target.UNKNOWN
        situation = _plan.Situation(
            "front door",
            _settings.current_policy().value,
            target.platform,
            interpret=interpret,
            forced_by_jax=_internals.forced_interpret_value(),
            inside_export=_target.inside_export(),
            net_gap=installation.lowering_net_gap(entry),
            accelerator_plugins=bool(_target.installed_accelerator_plugins()),
            candidates=call.candidates,
            grid=call.grid,
            max_steps=_settings.max_steps().value,
        )
        return _enter(wrapped, call, situation, target)

    pallas_guard_front_door.__qualname__ = f"pallas_guard_front_door[{entry.label}]"
    wrapper = _entry_point_wrapper_class()(original, pallas_guard_front_door, installation.is_active)
    # wrapt keeps `_self_`-prefixed attributes on the proxy itself: our marker for idempotence.
    wrapper._self_pallas_guard = True  # noqa: SLF001
    return wrapper


def _enter(wrapped: Callable[..., Any], call: _KernelCall, situation: _plan.Situation, target: _target.Target) -> Any:
    """Carry out the plan for one call of an entry point; what it returns goes to the caller."""
    plan = _plan.plan(situation)
    if plan.action is _plan.Action.DEFER and plan.replan:
        return _deferred(wrapped, call, situation)
    if plan.action in (_plan.Action.UNTOUCHED, _plan.Action.DEFER):
        return wrapped(*call.args, **call.kwargs)
    policy = _settings.current_policy()
    call_site = _diagnostics.user_call_site()
    if plan.action is _plan.Action.REFUSE:
        _act.carry_out(
            plan,
            layer="front door",
            kernel=call.info,
            call_site=call_site,
            target=_fallback(target, plan),
            policy=policy,
            interpreter=call.candidates().names[0] if plan.over_budget else None,
            grid=call.grid,
            budget=_settings.max_steps(),
        )
    return _Guarded(call, wrapped, plan, target, policy, call_site).first()


def _deferred(wrapped: Callable[..., Any], call: _KernelCall, situation: _plan.Situation) -> Any:
    """A kernel built before the target was known (a decorator run at import, before any array
    exists) that needs the front door: the plan is made again when it is called."""
    built = wrapped(*call.args, **call.kwargs)
    if not callable(built) or not call.entry.returns_kernel(call.args, call.kwargs):
        return built
    resolved: list[Any] = []

    def pallas_guard_deferred(
        kernel: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        if not resolved:
            # Configuration only: the call may be traced for an AOT lowering for cuda/tpu, which
            # must stay untouched; still unknown, the lowering net decides (plain).
            target = _target.detect()
            if target.platform is None:
                return kernel(*args, **kwargs)
            now = situation._replace(platform=target.platform, policy=_settings.current_policy().value)
            resolved.append(_enter(wrapped, call, now, target))
        return resolved[0](*args, **kwargs)

    return _kernel_wrapper_class()(built, pallas_guard_deferred)


def _fallback(target: _target.Target, plan: _plan.Plan) -> _target.Target:
    """The target a refusal names: an unknown one is taken as the CPU when the plan fell back."""
    if target.platform is None and plan.fallback is not None:
        return _target.Target("cpu", ("the target is not configured and no accelerator plugin is installed",))
    return target


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
            # as pickle or cloudpickle would without the guard) and nothing of pallas_guard is
            # needed to load it.
            return operator.itemgetter(0), ((self.__wrapped__,),)

    return KernelWrapper
