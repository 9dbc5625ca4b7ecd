"""The front door: wrappers on the entry points that build Pallas kernels (``_entry_points``).

Building a kernel decides nothing: what the entry point returns is wrapped, and each call of it (the
kernel traced, or run eagerly) gathers the situation with the settings in force there, asks
``_plan`` what to do, and acts. Most calls pass straight through: the lowering net decides at
lowering, where the target is certain (strict refuses there, the plain interpreter is substituted
there). Only what must happen at the call happens here: a kernel that needs the TPU or Mosaic-GPU
interpreter (they add effects while tracing), or whose choice must be verified, goes to the engine
(``_engine``); a kernel over the step budget, or one no lowering net would catch, is refused.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

from pallas_guard._checks import checked_plain
from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import act as _act
from pallas_guard._deciding import device as _device
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._deciding import plan as _plan
from pallas_guard._deciding import target as _target
from pallas_guard._deciding.kernel import Kernel
from pallas_guard._guard import engine as _engine
from pallas_guard._guard.ledger import Guarding
from pallas_guard._jax import config as jax_config
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import plain as _plain
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.entry_points import EntryPoint, HostQuestion
from pallas_guard._vocabulary.enums import Policy


def wrap_entry_point(original: Callable[..., Any], entry: EntryPoint, installation: Guarding) -> Any:
    """The wrapper that replaces ``original``; it acts only while ``installation`` is active."""

    def pallas_guard_front_door(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        try:
            built = wrapped(*args, **kwargs)
        except Exception as error:
            note_which_accelerator(error)
            raise
        if not callable(built):
            return built
        kernel = Kernel(entry, wrapped, args, kwargs)
        if kwargs.get("interpret"):
            # The caller chose an interpreter: JAX's own, untouched, but for the key of an eager
            # plain run the guard checks (below).
            return _by_hand(kernel, built, installation) if kwargs["interpret"] is True else built
        if entry.returns_kernel(args, kwargs):
            return _guarded_kernel(kernel, built, installation)
        return _guarded_decorator(kernel, built, installation)

    pallas_guard_front_door.__qualname__ = f"pallas_guard_front_door[{entry.label}]"
    wrapper = _entry_point_wrapper_class()(original, pallas_guard_front_door, installation.is_active)
    # wrapt keeps `_self_`-prefixed attributes on the proxy itself: our marker for idempotence.
    wrapper._self_pallas_guard = True  # noqa: SLF001
    return wrapper


def _guarded_kernel(kernel: Kernel, built: Any, installation: Guarding) -> Any:
    """The kernel callable JAX returned, deciding at each call (a proxy: it keeps its attributes)."""

    def pallas_guard_kernel(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        __tracebackhide__ = True
        del instance
        return at_call(kernel, wrapped, args, kwargs, installation)

    return _kernel_wrapper_class()(built, pallas_guard_kernel, installation.is_active)


def _by_hand(kernel: Kernel, built: Any, installation: Guarding) -> Any:
    """A kernel built with ``interpret=True``: it runs as built, except that an eager call under
    checks or the guard's plain interpretation runs marked with them (the net lowers the user's
    plain interpreter its own way too), so that JAX's executable for it is never reused under other
    settings, nor JAX's own under these."""
    if not kernel.entry.returns_kernel(kernel.args, kernel.kwargs):
        return built

    def pallas_guard_by_hand(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        __tracebackhide__ = True
        del instance
        checks = checked_plain.plain(_settings.current("checks").value)
        fast_plain = _plain.enabled()
        if not (checks or fast_plain) or jax_tracing.tracing() or _settings.current_policy().value is Policy.OFF:
            return wrapped(*args, **kwargs)
        marks = checked_plain.mark(checks, fast_plain=fast_plain)
        with kernel.lock:
            marked = kernel.variants.get(("by hand", *marks.items()))
        if marked is None:
            marked = kernel.build(marks=marks)
            with kernel.lock:
                marked = kernel.variants.setdefault(("by hand", *marks.items()), marked)
        try:
            return marked(*args, **kwargs)
        except Exception as error:
            finding = _diagnostics.finding_in(error)
            if finding is not None:
                raise finding from error
            raise

    return _kernel_wrapper_class()(built, pallas_guard_by_hand, installation.is_active)


def _guarded_decorator(kernel: Kernel, decorator: Any, installation: Guarding) -> Any:
    """A decorator form (``@pl.kernel(mesh=...)``, ``pl.core_map(mesh)``): applied to its body, it
    gives a guarded kernel, or (``core_map``) runs the body, which is the call."""

    @functools.wraps(decorator)
    def pallas_guard_decorator(body: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if args or kwargs or not installation.is_active():
            return decorator(body, *args, **kwargs)
        applied = Kernel(kernel.entry, kernel.original, kernel.args, kernel.kwargs, decorated=body)
        if kernel.entry.runs_when_applied:
            return at_call(applied, lambda: decorator(body), (), {}, installation)
        return _guarded_kernel(applied, decorator(body), installation)

    return pallas_guard_decorator


def at_call(
    kernel: Kernel, run_as_built: Callable[..., Any], args: tuple[Any, ...], kwargs: Any, installation: Guarding
) -> Any:
    """One call of ``kernel``: gather, plan, act. ``run_as_built`` runs it as JAX built it."""
    __tracebackhide__ = True
    policy = _settings.current_policy()
    budget = _settings.max_steps()
    target = _target.detect()
    situation = _plan.Situation(
        "front door",
        policy.value,
        target.platform,
        forced_by_jax=jax_config.forced_interpret_value(),
        net_gap=installation.lowering_net_gap(kernel.entry),
        accelerator_plugins=bool(_target.installed_accelerator_plugins()),
        candidates=functools.partial(candidates, kernel),
        grid=kernel.grid,
        max_steps=budget.value,
        eager=not jax_tracing.tracing(),
    )
    plan = _plan.plan(situation)
    if plan.action in (_plan.Action.UNTOUCHED, _plan.Action.DEFER):
        try:
            with installation.ledger.calling(kernel.info):
                return run_as_built(*args, **kwargs)
        except Exception as error:
            # An eager call ran here: the net's bounds check raised its finding inside JAX's error.
            finding = _diagnostics.finding_in(error)
            if finding is not None:
                raise finding from error
            note_which_accelerator(error)
            raise
    call_site = _diagnostics.user_call_site()
    if plan.action is _plan.Action.REFUSE:
        if not plan.over_budget and plan.fallback is None:
            # A body that cannot even be traced fails with its own error, as it does under jit (where
            # the refusal waits for lowering): the CPU is not what is wrong with it.
            import jax

            jax.eval_shape(functools.partial(run_as_built, **kwargs), *args)
        _act.carry_out(
            plan,
            layer="front door",
            kernel=kernel.info,
            call_site=call_site,
            target=_fallback(target, plan),
            policy=policy,
            interpreter=(plan.candidates or candidates(kernel)).names[0] if plan.over_budget else None,
            grid=kernel.grid,
            budget=budget,
        )
    device = _settings.current("device").value
    run = _engine.Run(
        kernel,
        plan,
        target=target,
        policy=policy,
        call_site=call_site,
        ledger=installation.ledger,
        hooks=installation.hooks,
        tpu_cores=_device.tpu_cores(device),
    )
    return run(args, kwargs)


def wrap_host_question(original: Callable[..., Any], question: HostQuestion, installation: Guarding) -> Any:
    """The wrapper that replaces a host function asking which accelerator this is: JAX's own call,
    and where it fails on the CPU while the guard interprets, the note an entry point's gets."""

    def pallas_guard_host_question(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        del instance
        try:
            with _device.answering():
                return wrapped(*args, **kwargs)
        except Exception as error:
            if _device.interpreting_on_cpu():
                note_which_accelerator(error)
            raise

    pallas_guard_host_question.__qualname__ = f"pallas_guard_host_question[{question.label}]"
    wrapper = _entry_point_wrapper_class()(original, pallas_guard_host_question, installation.is_active)
    wrapper._self_pallas_guard = True  # noqa: SLF001
    return wrapper


def note_which_accelerator(error: BaseException) -> None:
    """Host code that asked which TPU/GPU it runs on and got the CPU: which device setting answers
    it (a note: the error keeps its type). Nothing where a device is already presented."""
    hint = _interpreters.which_accelerator_failure(error)
    if hint is not None and _device.wanted() is None:
        _diagnostics.add_note(error, f"pallas_guard: {hint}.")


def candidates(kernel: Kernel) -> _interpreters.Candidates:
    """The interpreters for ``kernel`` under the settings in force here, best first; an interpreter
    this jax lacks is no candidate."""
    checks = _settings.current("checks")
    chosen = _interpreters.candidates(
        _settings.current_interpreter(),
        kernel.facts,
        checks=frozenset(checks.value),
        checks_from=checks.source,
        effects_refused=jax_tracing.effects_refused(),
    )
    names = tuple(name for name in chosen.names if _interpreters.available(name)) or ("plain",)
    lacking = names != chosen.names
    # The checks the engine runs itself (before or after the interpretation) join the interpreter's.
    at_front_door = frozenset(check.name for check in _checks.in_force(checks.value) if check.at_front_door)
    return chosen._replace(
        names=names,
        verify=chosen.verify and len(names) > 1,
        lacking=lacking,
        checked=chosen.checked | at_front_door,
        at_front_door=bool(at_front_door),
    )


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
        """The callable an entry point returned, guarded at each call; pickles as that callable."""

        def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
            # itemgetter(0)((x,)) is x: the wrapped callable is pickled (by value or by reference,
            # as pickle or cloudpickle would without the guard) and nothing of pallas_guard is
            # needed to load it.
            return operator.itemgetter(0), ((self.__wrapped__,),)

        def lower(self, *args: Any, **kwargs: Any) -> Any:
            return _staged(self, "lower", args, kwargs)

        def trace(self, *args: Any, **kwargs: Any) -> Any:
            return _staged(self, "trace", args, kwargs)

    return KernelWrapper


def _staged(wrapper: Any, stage: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``kernel.lower(...)``/``kernel.trace(...)`` on a kernel JAX returned jitted: JAX's own, unless
    a check in force acts at the call (it lowers or compiles the kernel for its target, or runs
    it), which a stage method would skip; then staged through the guarded call, as
    ``jax.jit(kernel).lower(...)`` is."""
    own = getattr(wrapper.__wrapped__, stage)  # AttributeError as without the guard
    if not wrapper._self_enabled() or not _checks.at_front_door(_settings.current("checks").value):  # noqa: SLF001
        return own(*args, **kwargs)
    import jax

    return getattr(jax.jit(wrapper), stage)(*args, **kwargs)
