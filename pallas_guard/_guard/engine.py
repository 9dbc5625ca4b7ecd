"""The interpreted-kernel engine: runs one call of a kernel in the interpreter chosen for it.

The front door hands over a kernel, its plan (``Action.INTERPRET``: the candidate interpreters,
best first) and the call's arguments. Where the candidates are ambiguous (``Candidates.verify``),
each is lowered on trial for the CPU until one lowers; the choice is kept per kernel identity and
argument shapes. The trial is the real work, not a rehearsal: the kernel runs through a ``jax.jit``
of the chosen variant, whose trace and lowering the trial already made (an eager first call costs
what a hand-written one does; under an outer trace the body is traced once). Under an outer trace,
plain is verified without a lowering of its own (the outer lowering lowers it anyway): its
interpreter is traced once, checked for CPU lowering rules, and replayed there (``PlainTraces``).
An eager call that fails at run time moves on to the next candidate.

The plain interpreter is substituted by the lowering net, which knows the real target, except for
an eager call, which runs now on the configured (CPU) target: there the engine records it itself
and the net stays out (``Ledger.verification``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from pallas_guard._checks import checked_plain
from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import act as _act
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._deciding import plan as _plan
from pallas_guard._deciding.kernel import Kernel
from pallas_guard._deciding.target import Target
from pallas_guard._guard.ledger import Ledger, Settled
from pallas_guard._jax import config as jax_config
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import findings as _findings
from pallas_guard._running import plain as _plain
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.enums import Policy
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.record import MemoryUse

_NEVER_RETRIED = (MemoryError, RecursionError)
"""Failures of the machine, not of an interpreter: they propagate and pin nothing."""


def interpret_value(name: str, candidates: _interpreters.Candidates, *, cores: int | None = None) -> Any:
    """The ``interpret=`` value that runs a kernel in interpreter ``name``; None for plain (the
    lowering net substitutes ``True``), or when this jax lacks that interpreter. ``cores``: those
    of the TPU device set, which TPU interpret mode then simulates per device."""
    if name == "plain":
        return None
    cls = jax_pallas.tpu_params_class() if name == "tpu" else jax_pallas.gpu_params_class()
    if cls is None:
        jax_lookup.note_missing(f"{name.upper()} interpret params class", f"the {name} interpreter is unavailable")
        return None
    overrides: dict[str, Any] = {}
    if name == "tpu" and candidates.eager_dmas:
        # With the default "on_wait" DMA execution, remote copies land late: the all-gather kernel
        # returns NaN shards. Eager execution is what makes cross-device kernels correct.
        overrides["dma_execution_mode"] = "eager"
    if candidates.detect_races:
        # "warn" (jax >= 0.12) lets the kernel finish so the guard can name it in its error.
        overrides.update(detect_races=True, on_race="warn")
    # JAX raises on an out-of-bounds read by default; the guard does only where bounds is asked for:
    # a check nobody asked for must not fail a kernel the TPU runs (whose out-of-bounds read is
    # garbage, not an error; an empty copy included, which JAX's interpreter has taken for one).
    overrides["out_of_bounds_reads"] = "raise" if "bounds" in candidates.checked else "uninitialized"
    if name == "tpu" and cores is not None:
        overrides["num_cores_or_threads"] = cores
    # Only the fields this jax's class has (dma_execution_mode, on_race, ... vary by version).
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(overrides)
    value = cls(**{k: v for k, v in overrides.items() if k in fields})
    with contextlib.suppress(AttributeError, TypeError):  # a frozen dataclass takes it this way
        object.__setattr__(value, jax_pallas.GUARDS_RUN, True)
    return value


def _shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    import jax

    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


class PlainTraces:
    """The plain interpreter traced by a trial under an outer trace, for the outer lowering.

    Under an outer trace the front door must choose at the call, but the kernel lowers later, with
    the outer trace. A trial that lowers plain for real lowers it twice (the trial, then the outer
    lowering), tracing the interpreter (state discharge, the grid loop) each time. Instead the trial
    traces the interpreter once, checks that JAX has a CPU lowering for every primitive in that
    trace, and keeps the trace; the outer lowering replays it (JAX keeps the kernel body's trace, so
    the equation's params are the same objects). A trace is replayed once, and only for the
    equation it was made from: the same params objects, a kernel jaxpr still alive, equal argument
    avals and equation context, the same trace configuration, outside a ``shard_map`` body.
    Anything else, or a missing internal, lowers as JAX alone does.
    """

    _MAX_KEPT = 16  # a trial's trace waits for one outer lowering; traces never lowered age out

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[int, tuple[Any, tuple[tuple[str, Any], ...], Hashable, Any]] = (
            collections.OrderedDict()
        )

    @staticmethod
    def _others(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        """The params besides the kernel jaxpr and ``interpret`` (which the net substitutes)."""
        return tuple((name, value) for name, value in params.items() if name not in ("jaxpr", "interpret"))

    def trace(self, eqn: Any) -> bool:
        """Trace the plain interpreter for ``eqn`` (a ``pallas_call`` equation), check that every
        primitive of that trace lowers for the CPU, keep it; False where this cannot be told so
        cheaply (then a real lowering tells)."""
        params = eqn.params
        registry = jax_lowering.lowering_registry()
        tools = jax_lowering.lowering_tools()
        interpreter = jax_pallas.plain_interpreter(params)
        avals = [getattr(var, "aval", None) for var in eqn.invars]
        if registry is None or tools is None or interpreter is None:
            return False
        if not all(type(aval).__name__ == "ShapedArray" for aval in avals):
            return False
        try:
            ref = weakref.ref(params["jaxpr"])
            # Inside the equation's context, where JAX's rule traces it (and where the net will).
            with jax_lowering.equation_context(eqn), _plain.linear(params):
                config = jax_config.trace_context()
                traced = tools[0](interpreter)(*avals)
        except Exception:  # a real lowering raises JAX's own error for it
            return False
        if config is None:
            return False
        if not all(jax_lowering.lowers_for_cpu(e.primitive, registry) for e in jax_state.jaxpr_equations(traced)):
            return False
        context = (config, _plain.enabled(), jax_lowering.lowering_context_key(avals, getattr(eqn, "ctx", None)))
        with self._lock:
            self._kept[id(params["jaxpr"])] = (ref, self._others(params), context, traced)
            while len(self._kept) > self._MAX_KEPT:
                self._kept.popitem(last=False)
        return True

    def _take(self, ctx: Any, params: Mapping[str, Any]) -> Any:
        jaxpr = params.get("jaxpr")
        with self._lock:
            kept = self._kept.get(id(jaxpr))
        if kept is None or jax_lowering.manual_axes(ctx):
            return None
        ref, others, context, traced = kept
        now = self._others(params)
        if ref() is not jaxpr or len(now) != len(others):
            return None
        if not all(a[0] == b[0] and a[1] is b[1] for a, b in zip(now, others, strict=True)):
            return None
        config = jax_config.trace_context()
        avals = getattr(ctx, "avals_in", ())
        key = (config, _plain.enabled(), jax_lowering.lowering_context_key(avals, getattr(ctx, "jaxpr_eqn_ctx", None)))
        try:
            same = config is not None and bool(key == context)
        except Exception:  # a context that cannot be compared is not the same
            same = False
        if not same:
            return None
        with self._lock:
            if self._kept.get(id(jaxpr)) is not kept:
                return None
            del self._kept[id(jaxpr)]
        return traced

    def reusing(self, delegate: Callable[..., Any]) -> Callable[..., Any]:
        """JAX's lowering rule ``delegate`` for ``pallas_call_p``, replaying a kept plain trace."""

        def lower_pallas_call(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
            if params.get("interpret") is True and id(params.get("jaxpr")) in self._kept:  # a racy peek
                traced = self._take(ctx, params)
                tools = jax_lowering.lowering_tools()
                if traced is not None and tools is not None:
                    _, replay, lower_fun = tools
                    return lower_fun(replay(traced), multiple_results=True)(ctx, *in_nodes)
            return delegate(ctx, *in_nodes, **params)

        return lower_pallas_call


PLAIN_TRACES = PlainTraces()


class Run:
    """One call of an interpreted kernel, under the settings in force at the call."""

    def __init__(
        self,
        kernel: Kernel,
        plan: _plan.Plan,
        *,
        target: Target,
        policy: _settings.Setting[Policy],
        call_site: _diagnostics.CallSite,
        ledger: Ledger,
        hooks: list[Any],
        tpu_cores: int | None = None,
    ) -> None:
        assert plan.candidates is not None
        self.tpu_cores = tpu_cores
        self.kernel, self.plan, self.target, self.policy = kernel, plan, target, policy
        self.candidates = plan.candidates
        self.call_site, self.ledger = call_site, ledger
        self.hooks = hooks
        """The installation's: a check that wraps a JAX function for its work adds what puts it back."""
        self.eager = not jax_tracing.tracing()
        # An eager call is built marked with its checks and interpretation: JAX keeps one executable
        # per equation, and the guard's must not be reused under other settings, policy off or after
        # uninstall().
        self.fast_plain = _plain.enabled()
        self.marks = checked_plain.mark(self.candidates.checked, fast_plain=self.fast_plain) if self.eager else None
        self.checks = _checks.in_force(self.candidates.checked)
        self.call_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.check_notes: tuple[str, ...] = ()
        """What the checks said of this call's kernel and shapes (the decision's notes)."""
        self.memory: tuple[MemoryUse, ...] = ()
        """What the kernel takes of each TPU generation's memories (the compile check's figures)."""
        self.learned: list[str] = []
        """What the net said of the kernel while the front door tried it (a check it could not apply)."""

    @staticmethod
    def called_in() -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """The axis names and sizes of the ``shard_map`` mesh the kernel is called in, or None."""
        return jax_tracing.manual_mesh()

    # --- the kernel in each interpreter ------------------------------------------------------------

    def _variant(self, name: str) -> tuple[Any, Any]:
        """(the kernel built for interpreter ``name``, its ``interpret=`` value); one object per
        kernel, interpreter and settings, so the net recognises what the front door injected."""

        def build() -> tuple[Any, Any]:
            value = interpret_value(name, self.candidates, cores=self.tpu_cores)
            if value is None:  # plain: the kernel as built (marked), the net substitutes the interpreter
                return self.kernel.build(marks=self.marks), None
            self.ledger.mark_injected(value)
            jax_pallas.start_each_run_clean(name, self.hooks)
            return self.kernel.build(value), value

        built, value = self._memo((name,), build)
        return built, value

    def variant(self, name: str) -> Callable[..., Any]:
        """The kernel built for interpreter ``name``, to call inside a trace of one's own."""
        built: Callable[..., Any] = self._variant(name)[0]
        return built

    def jitted(self, name: str) -> Callable[..., Any]:
        """The variant for ``name`` under ``jax.jit``: its trial lowering is kept for the real call."""
        import jax

        jitted: Callable[..., Any] = self._memo(("jit", name), lambda: jax.jit(self._variant(name)[0]))
        return jitted

    def _memo(self, key: tuple[Hashable, ...], make: Callable[[], Any]) -> Any:
        """What ``make`` gives, once per kernel object, ``key`` and the settings that shape it."""
        c = self.candidates
        key = (*key, c.detect_races, c.checked, c.eager_dmas, self.tpu_cores, self.eager, self.fast_plain)
        with self.kernel.lock:
            known = self.kernel.variants.get(key)
        if known is None:
            made = make()
            with self.kernel.lock:
                known = self.kernel.variants.setdefault(key, made)
        return known

    def _quiet_net(self, name: str) -> contextlib.AbstractContextManager[None]:
        """An eager plain run is recorded here; the net substitutes the interpreter silently."""
        return self.ledger.verification() if self.eager and name == "plain" else contextlib.nullcontext()

    @staticmethod
    def _trial(name: str, jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Lower ``jitted`` on trial. Inside ``shard_map`` a lowering of its own has none of the
        mesh's axes bound, which TPU interpret mode asks its device's index on: there its trial is
        its trace (where it does its work), made in the ``shard_map``'s own. The plain interpreter
        works at lowering, which only its own lowering tries."""
        if name != "plain" and jax_tracing.manual_mesh() is not None:
            jitted.trace(*args, **kwargs)
        else:
            jitted.lower(*args, **kwargs)

    def _plain_traced(self, name: str, jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Under an outer trace, plain verified without a lowering of its own: the outer lowering
        lowers the kernel anyway, replaying the interpreter traced here (``PlainTraces``). False
        where that cannot tell: the trial then lowers for real. Under the bounds check too: the
        checked interpretation is the unchecked one with index checks (which lower for the CPU),
        and the net falls back to the unchecked one where the check cannot be made, so plain
        lowers with the check iff it lowers without; the check's own lowering, the costly one, is
        left to the outer lowering, made once."""
        if name != "plain" or self.eager:
            return False
        primitive = jax_pallas.pallas_call_primitive()
        trace = getattr(jitted, "trace", None)
        if primitive is None or trace is None:
            return False
        traced = trace(*args, **kwargs)  # the kernel's own trace error is plain's failure, as before
        eqns = [e for e in jax_state.jaxpr_equations(getattr(traced, "jaxpr", None)) if "interpret" in e.params]
        if not eqns or any(e.primitive is not primitive or e.params.get("interpret") for e in eqns):
            return False
        return all(PLAIN_TRACES.trace(eqn) for eqn in eqns)

    # --- the call ----------------------------------------------------------------------------------

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True
        key = self.settled_key(args, kwargs)
        self.call_args = (args, kwargs)
        outputs = None
        notes = []
        memory: list[MemoryUse] = []
        pending: list[tuple[_checks.Check, tuple[Hashable, ...], Callable[[], _checks.Prepared]]] = []
        context = self._check_context()
        for check in self.checks:  # first: a kernel a check refuses never runs, nor returns a result
            check_key = (*key, check.name, *context)
            prepared = self._prepare(check, check_key, args, kwargs)
            if prepared.note:
                notes.append(prepared.note)
            memory.extend(prepared.memory)
            if prepared.outputs is not None:
                outputs = prepared.outputs
            if prepared.pending is not None:
                pending.append((check, check_key, prepared.pending))
        self.check_notes, self.memory = tuple(notes), tuple(memory)
        if not pending:
            return self._call(key, args, kwargs, outputs)
        try:
            out = self._call(key, args, kwargs, outputs)
        except _NEVER_RETRIED:
            raise
        except Exception as error:
            self._finish(pending, failure=error)  # the check's finding, where it has one, wins
            raise
        if not self._wait_before_the_run(pending):
            self._finish(pending, failure=None)
        return out

    def _wait_before_the_run(
        self, pending: list[tuple[_checks.Check, tuple[Hashable, ...], Callable[[], _checks.Prepared]]]
    ) -> bool:
        """Whether the checks' waits are left to the first run of the program the kernel is traced
        in: traced by a jit call, which lowers, compiles and runs the program before it returns
        (not ``.lower()`` or ``eval_shape``, which must judge as they trace). The compile started
        beside the trace then overlaps the program's lowering and XLA's compile; a refusal still
        stops the call before anything of the program runs."""
        call = None if self.eager else jax_tracing.jit_call_frame()
        if call is None:
            return False
        return _findings.wait_before_the_run(call, functools.partial(self._finish, pending, failure=None, after=True))

    def _finish(
        self,
        pending: list[tuple[_checks.Check, tuple[Hashable, ...], Callable[[], _checks.Prepared]]],
        *,
        failure: BaseException | None,
        after: bool = False,
    ) -> None:
        """What the checks that worked beside the run settle: their notes and figures added to the
        decision, or their finding raised (from the run's own failure, where it failed). ``after``:
        waited for just before a jit call's program runs (its compile overlapping the program's
        lowering and compile), when the decision is recorded already."""
        __tracebackhide__ = True
        for check, check_key, finish in pending:
            try:
                prepared = finish()
            except PallasGuardError as finding:
                if after:  # the program's lowering recorded the kernel as interpreted: it never ran
                    _record.withdraw(self.kernel.info, self.call_site, action="interpreted")
                if failure is None:
                    raise
                raise finding from failure
            self._settle_check(check_key, check, prepared)
            if prepared.note:
                self.ledger.annotate(
                    self.kernel.info, self.call_site, prepared.note, memory=prepared.memory, recorded=after
                )

    def _call(self, key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> Any:
        __tracebackhide__ = True
        known = self.settled(key)
        if known is not None and outputs is not None:
            # A check ran the kernel in the interpreter settled on: that run is the call's result.
            self._commit(known[0], known[1])
            self._after(outputs, known[0])
            return outputs
        if known is not None:
            return self._run(known[0], args, kwargs, tried=known[1])
        if not self.candidates.verify:
            return self._run(self.candidates.names[0], args, kwargs, tried=())
        return self._verify_and_run(args, kwargs, key)

    def _prepare(
        self, check: _checks.Check, check_key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _checks.Prepared:
        """What ``check`` needs before the run, once per kernel identity and shapes (settled under
        ``check_key``; a finding is raised at every call, nothing is settled for it)."""
        __tracebackhide__ = True
        known = self.settled(check_key)
        if known is not None:
            notes = [entry for entry in known[1] if isinstance(entry, str)]
            memory = tuple(entry for entry in known[1] if isinstance(entry, MemoryUse))
            return _checks.Prepared(notes[0] if notes else None, memory=memory)
        prepared = check.before(self, args, kwargs) or _checks.Prepared()
        if prepared.settles and prepared.pending is None:
            self._settle_check(check_key, check, prepared)
        return prepared

    def _settle_check(self, check_key: tuple[Hashable, ...], check: _checks.Check, prepared: _checks.Prepared) -> None:
        self.settle(check_key, (check.name, ((prepared.note,) if prepared.note else ()) + prepared.memory))

    @staticmethod
    def _check_context() -> tuple[Hashable, ...]:
        """What a check's settled work depends on besides the kernel and shapes: the device setting
        (the target it lowers or compiles for), require_checks (whether a check that cannot run
        fails the call), the headroom (what compiles too tightly), and the mesh a shard_map maps
        the kernel over (a compile is for the program it is in)."""
        settings = ("device", "require_checks", "vmem_headroom")
        return (*(_settings.current(name).value for name in settings), jax_tracing.manual_mesh())

    def settled(self, key: tuple[Hashable, ...]) -> Settled | None:
        return self.ledger.settled(key) if key[0] is not None else self.kernel.settled.get(key)

    def settled_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, ...]:
        c = self.candidates
        return (self.kernel.identity, c.names, c.checked, _shape_key(args, kwargs))

    def settle(self, key: tuple[Hashable, ...], choice: Settled) -> None:
        if key[0] is not None:
            self.ledger.settle(key, choice)
        else:
            with self.kernel.lock:
                self.kernel.settled[key] = choice

    def _run(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, tried: tuple[str, ...]) -> Any:
        """Run in ``name``, chosen without a trial (the only candidate, or settled before)."""
        __tracebackhide__ = True
        self._commit(name, tried)
        with self._quiet_net(name):
            if self.kernel.entry.runs_when_applied:  # core_map: building it runs the body
                out = self._explained(lambda: self._variant(name)[0], name, (), {})
            else:
                out = self._explained(self._variant(name)[0], name, args, kwargs)
        self._after(out, name)
        return out

    def _verify_and_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: tuple[Hashable, ...]) -> Any:
        __tracebackhide__ = True
        failures: list[tuple[str, BaseException, str]] = []  # (interpreter, error, when)
        names = self.candidates.names
        for index, name in enumerate(names):
            jitted = self.jitted(name)
            try:
                with self.ledger.verification(), _record.collecting_notes(self.learned):
                    # Tracers of an outer trace lower as their avals (memory spaces, weak types
                    # kept): the call below then reuses this trial's trace of the body.
                    if not self._plain_traced(name, jitted, args, kwargs):
                        self._trial(name, jitted, args, kwargs)
            except _NEVER_RETRIED:
                raise
            except Exception as error:
                failures.append((name, error, "failed"))
                continue
            tried = (*(f"{n}: {when} ({_diagnostics.first_line(e)})" for n, e, when in failures), f"{name}: ok")
            if not self.eager:
                self.settle(key, (name, tried))
                self._commit(name, tried)
                # Plain stays the kernel as built: an AOT lowering of this trace for an accelerator
                # must be what JAX alone gives. Another interpreter reuses the trial's trace.
                out = self._variant(name)[0](*args, **kwargs) if name == "plain" else jitted(*args, **kwargs)
                self._after(out, name)
                return out
            try:
                with self._quiet_net(name):
                    out = jitted(*args, **kwargs)
                self._after(out, name)
            except _NEVER_RETRIED:
                raise
            except Exception as error:
                finding = self.finding(error)
                if finding is not None:
                    raise finding from error
                if isinstance(error, PallasGuardError):
                    raise
                if index + 1 == len(names):
                    self._explain(error, name)
                    self._note_failure(error, name, failures)
                    raise
                # It lowered but failed at run time; its clean-up may not have run.
                if name != "plain":
                    jax_pallas.reset_interpreter(name)
                failures.append((name, error, "failed at run time"))
                continue
            self.settle(key, (name, tried))
            self._commit(name, tried)
            return out
        if len({_diagnostics.first_line(error) for _, error, _ in failures}) == 1:
            # Every interpreter failed the same way: the kernel's own error (a shape mismatch, a bad
            # index). The real call runs with the first candidate and raises it unchanged.
            tried = tuple(f"{n}: {when} ({_diagnostics.first_line(e)})" for n, e, when in failures)
            self.settle(key, (names[0], tried))
            return self._run(names[0], args, kwargs, tried=tried)
        raise _diagnostics.no_interpreter(
            [(name, error) for name, error, _ in failures],
            kernel=self.kernel.info,
            call_site=self.call_site,
            target=self.target,
            why=self.candidates.reason,
        ) from failures[0][1]

    # --- what the checks use -----------------------------------------------------------------------

    def run_now(self, name: str, args: Any, kwargs: Any) -> Any:
        """The kernel's outputs in interpreter ``name``, computed now (eager calls only)."""
        with self.ledger.verification():
            return self.jitted(name)(*args, **kwargs)

    # --- carrying the choice out -------------------------------------------------------------------

    def _commit(self, name: str, tried: tuple[str, ...]) -> None:
        """Record (and warn) for interpreter ``name``; a plain run under a trace is the net's to
        record, at lowering, where the target is certain: the ledger tells it what was tried."""
        notes = tuple(
            dict.fromkeys(
                note
                for note in (self.candidates.checks_note, self.candidates.note, *self.check_notes, *self.learned)
                if note
            )
        )
        if name != "plain" and jax_tracing.export_platforms() is not None:
            raise _diagnostics.unexportable(
                kernel=self.kernel.info,
                call_site=self.call_site,
                interpreter=name,
                why=self.candidates.reason,
                tried=tried,
            )
        if name == "plain" and not self.eager:
            self.ledger.leave_to_net(self.kernel.info, tried=tried, notes=notes, memory=self.memory)
            return
        _act.carry_out(
            self.plan,
            layer="front door",
            kernel=self.kernel.info,
            call_site=self.call_site,
            target=self.target,
            policy=self.policy,
            interpreter=name,
            tried=tried,
            notes=notes,
            memory=self.memory,
        )

    def _explained(self, function: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``function``; a failure the guard can attribute to the CPU becomes PallasGuardError."""
        __tracebackhide__ = True
        try:
            with _findings.eager_call(self.call_site):
                return function(*args, **kwargs)
        except PallasGuardError:
            raise
        except Exception as error:
            finding = self.finding(error)
            if finding is not None:
                raise finding from error
            self._explain(error, name)
            raise

    def finding(self, error: BaseException) -> PallasGuardError | None:
        """A check's finding (the kernel's fault, which no other interpreter must hide), as the
        guard's own error."""
        for check in self.checks:
            found = check.finding(self, error)
            if found is not None:
                return found
        return _findings.recorded_in(error, self.call_site)

    def _explain(self, error: BaseException, name: str) -> None:
        """What the guard knows of a failure the CPU or the interpreter caused, as a note on it."""
        if isinstance(error, PallasGuardError):
            return
        note = _diagnostics.interpreter_failure(
            error,
            kernel=self.kernel.info,
            call_site=self.call_site,
            target=self.target,
            policy=self.policy,
            interpreter=name,
            family=self.kernel.facts.family,
            why=self.candidates.reason,
        )
        if note is not None:
            _diagnostics.add_note(error, note)

    def _note_failure(self, error: BaseException, name: str, failures: list[tuple[str, BaseException, str]]) -> None:
        """The last candidate failed at run time: the error keeps its type and says what was tried."""
        _diagnostics.add_note(
            error,
            _diagnostics.runtime_failure_note(
                kernel=self.kernel.info,
                interpreter=name,
                why=self.candidates.reason,
                tried=[(n, _diagnostics.first_line(e), when) for n, e, when in failures],
            ),
        )

    def _after(self, out: Any, name: str) -> None:
        for check in self.checks:
            check.after(self, out, name)
