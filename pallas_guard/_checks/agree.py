"""The ``agree`` check: one kernel run in every interpreter that can run it, outputs compared.

A lowering that succeeds says nothing about the values an interpreter computes, and JAX's
interpreters have bugs of their own (a grid run as program 0 only, writes to captured refs
dropped). Where two interpreters run the same kernel on the same inputs, what the kernel defines
must agree: the output elements it wrote (an element it never writes is each interpreter's own
fill, or a block left over from the step before: not a value), integers and booleans bit for bit,
NaN equal to NaN whatever its payload, and floats within a bound no rounding difference reaches
(``float_bound``: two correct evaluations of one kernel round differently, through different XLA
fusions of transcendental functions and reductions, but not by a share of the output's magnitude).
Which one is right: the one the table of what each interpreter gets wrong does not name, else the
majority.

Each interpreter runs once, on the first call per kernel identity and shapes; the chosen one's
outputs are the call's result. Under an outer trace (``jax.jit``, ``eval_shape``, ``.lower()``)
nothing runs while tracing: a host callback traced into the computation receives the call's
operands and the chosen interpreter's outputs when, and only if, the computation runs, and the
other interpreters run on them once the computation is done, outside XLA. An interpreter beside
the chosen one that fails on a kernel the chosen one runs never fails the call: the decision says
it was not compared, unless its failure is the kernel's fault (an index out of range), which is a
finding.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary.errors import PallasGuardError

if TYPE_CHECKING:
    from pallas_guard._guard.engine import Run


def float_bound(dtype: Any, scale: float) -> float:
    """The largest difference two correct evaluations of a kernel may show in an output of floating
    ``dtype`` whose largest finite magnitude is ``scale``: the square root of the dtype's machine
    epsilon, times that magnitude. A correctly rounded result is within one epsilon of its value;
    XLA's approximations of transcendental functions, fused or not, stay within a few thousand
    (float32: 2^-23 each, the square root 2^-11.5, about 2900), and the cancellation of a sum or a
    reduction loses precision relative to the largest term, not to the difference. What the check
    is for, an interpreter computing a kernel wrongly (zeros, NaN, garbage, a dropped write), is
    off by a share of the output's magnitude, far past it."""
    import numpy as np

    return float(np.sqrt(_epsilon(dtype))) * scale


def _epsilon(dtype: Any) -> float:
    import jax.numpy as jnp

    finfo: Any = jnp.finfo
    return float(finfo(dtype).eps)


class Disagreement(NamedTuple):
    """The first element where two interpreters' outputs differ beyond what the check tolerates."""

    first: str
    second: str
    output: int
    """Which output (its position among the kernel's flattened outputs)."""
    at: tuple[int, ...]
    first_value: Any
    second_value: Any
    right: str
    """The interpreter taken as right: the one the majority of those compared agrees with; without
    a majority, the plain interpreter (the kernel discharged to XLA operations, nothing simulated)
    where it ran, else the first."""
    majority: bool


# --- the check ------------------------------------------------------------------------------------


class Agree(_checks.Check):
    name = "agree"
    order = 2
    at_front_door = True

    def before(self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared | None:
        __tracebackhide__ = True
        key = run.settled_key(args, kwargs)
        if run.settled(key) is not None:
            return None
        names = _pool(run)
        if not run.eager:
            # Nothing runs while tracing: the comparison is traced into the computation (after()),
            # where it can be: under jit alone, with a grid of known size.
            why = _not_traceable(run, args, kwargs)
            if why is not None:
                note = _checks.unchecked(self.name, why, kernel=run.kernel.info, call_site=run.call_site)
                return _checks.Prepared(note, settles=False)
            self._at_run_time.add(run)
            return _checks.Prepared(settles=False)
        outputs: dict[str, Any] = {}
        tried: list[str] = []
        failed: dict[str, BaseException] = {}
        for index, name in enumerate(names):
            # What JAX logs while tracing the body (an unused DMA descriptor) is logged once, by the
            # first interpreter's trace: the kernel is traced once as the user sees it.
            muted = jax_tracing.retrace_logs_muted() if index else contextlib.nullcontext()
            try:
                with muted, _findings.callback_failures_handled():
                    outputs[name] = run.run_now(name, args, kwargs)
            except (MemoryError, RecursionError):
                raise
            except Exception as error:
                finding = self.fault(run, name, error)
                if finding is not None:
                    raise finding from None
                failed[name] = error
                tried.append(f"{name}: failed ({_diagnostics.first_line(error)})")
                continue
            tried.append(f"{name}: ran")
        ran = [n for n in names if n in outputs]
        if not ran:
            return None  # no interpreter ran it on these inputs: the call fails (or verifies) as without the check
        chosen = next((n for n in run.candidates.names if n in outputs), ran[0])
        uncompared = self.not_compared(run, ran, failed)
        found = compare_outputs({n: leaves(outputs[n]) for n in ran}, ran, fills=_fills(run, ran, outputs[chosen]))
        if found is None:
            verdict = f"{', '.join(ran)} agree" if len(ran) > 1 else f"only {ran[0]} runs it"
            run.settle(key, (chosen, (*tried, f"agree: {verdict}")))
            return _checks.Prepared(uncompared, outputs=outputs[chosen])
        run.settle(key, (found.right, (*tried, f"agree: {found.first} and {found.second} disagree")))
        raise self.disagreement(run, found, ran) from None

    def fault(self, run: Run, name: str, error: BaseException) -> PallasGuardError | None:
        """The finding ``error`` of interpreter ``name`` is, where the kernel is at fault (a check's
        finding, an index out of range), else None; the interpreter is made ready to run again."""
        finding = run.finding(error)
        if finding is None:
            found = _diagnostics.bounds_error(error, kernel=run.kernel.info, call_site=run.call_site)
            if found is not None:
                info, site = run.kernel.info, run.call_site
                finding = _checks.found(self.name, found, kernel=info, call_site=site, interpreter=name)
        if finding is None and name != "plain":
            jax_pallas.reset_interpreter(name)  # it failed part way: its clean-up may not have run
        return finding

    def not_compared(self, run: Run, ran: Sequence[str], failed: Mapping[str, BaseException]) -> str | None:
        """The note for interpreters that failed where the kernel is not at fault: nothing was
        compared with them (and where only one ran, the check did not run)."""
        if not failed:
            return None
        why = "; ".join(
            f"{_interpreters.describe_interpreter(n)} fails on this kernel: {_diagnostics.first_line(e)}"
            for n, e in failed.items()
        )
        note = f"agree: not compared: {why}"
        if len(ran) > 1:
            return note
        return _checks.unchecked(self.name, why, kernel=run.kernel.info, call_site=run.call_site, note=note)

    def __init__(self) -> None:
        self._at_run_time: weakref.WeakSet[Run] = weakref.WeakSet()
        """The traced calls whose comparison waits for the computation to run."""

    def after(self, run: Run, out: Any, interpreter: str) -> None:
        if run not in self._at_run_time or run.call_args is None:
            return
        self._at_run_time.discard(run)
        args, kwargs = run.call_args
        run.call_args = None  # tracers of this trace: the callbacks traced below keep the run alive
        others = [n for n in _pool(run) if n != interpreter]
        if others:
            _compare_when_run(self, run, out, interpreter, others=others, args=args, kwargs=kwargs)

    def disagreement(self, run: Run, found: Disagreement, compared: Sequence[str]) -> PallasGuardError:
        """The finding for ``found``, recorded as a decision."""
        error = _diagnostics.disagreement(found, kernel=run.kernel.info, call_site=run.call_site, compared=compared)
        return _checks.found(self.name, error, kernel=run.kernel.info, call_site=run.call_site)


def _not_traceable(run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the comparison cannot be traced into this computation, or None: operands of another
    transformation than jit (vmap's batched values), or a grid whose size is traced."""
    import jax

    grid = run.kernel.grid
    if grid is not None and not all(isinstance(size, int) for size in grid):
        return "the grid's size is traced"
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.core.Tracer) and type(leaf).__name__ != "DynamicJaxprTracer":
            return f"called under a transformation other than jit ({type(leaf).__name__})"
    # A kernel without operands shows no tracer of the transformation it is called under (a
    # `jax.vmap(kernel, axis_size=2)()`), whose batching of the comparison's branch would fail.
    trace = jax_tracing.current_trace()
    if trace is not None and type(trace).__name__ != "DynamicJaxprTrace":
        return f"called under a transformation other than jit ({type(trace).__name__})"
    return None


def _pool(run: Run) -> list[str]:
    """Every interpreter that may run the kernel: its candidates first, then plain and TPU interpret
    mode, and the Mosaic-GPU interpreter for Mosaic-GPU kernels; those the table says get it wrong,
    and those this jax lacks, left out."""
    family = run.kernel.facts.family
    pool = (*run.candidates.names, "plain", "tpu", *(("gpu",) if family == "mosaic_gpu" else ()))
    names = [n for n in dict.fromkeys(pool) if _interpreters.available(n)]
    return [n for n in names if _interpreters.gets_wrong(n, run.kernel.facts) is None]


def _compare_when_run(
    check: Agree, run: Run, out: Any, chosen: str, *, others: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Under an outer trace: a host callback traced into the computation; on its first run it
    receives the call's operands and ``out`` and hands the comparison over (``_findings.hand_over``):
    once the computation is done, the other interpreters run on them and are compared, outside XLA,
    where an interpreter's failure is caught (not a failure of the computation) and a finding is
    raised to the caller."""
    import jax
    import numpy as np

    call_key = run.settled_key(args, kwargs)  # the callback holds keys, not this trace's tracers
    key = (*call_key, "agree at run time")
    fills = _fills(run, [chosen, *others], out)
    gate = _findings.await_gate()

    def compare(chosen_out: Any, call_args: Any, call_kwargs: Any) -> None:
        outputs = {chosen: leaves(chosen_out)}
        failed: dict[str, BaseException] = {}
        for name in others:
            try:
                with jax_tracing.retrace_logs_muted(), _findings.callback_failures_handled():
                    outputs[name] = leaves(run.run_now(name, call_args, call_kwargs))
            except (MemoryError, RecursionError):
                raise
            except Exception as error:
                finding = check.fault(run, name, error)
                if finding is not None:
                    raise finding.with_traceback(None) from None
                failed[name] = error
        names = [n for n in (chosen, *others) if n in outputs]
        note = check.not_compared(run, names, failed)
        found = compare_outputs(outputs, names, fills=fills)
        if found is None:
            verdict = f"{', '.join(names)} agree" if len(names) > 1 else None
            for said in (note, verdict and f"agree: {verdict}"):
                if said:
                    _record.annotate(run.kernel.info, run.call_site, said)
            return
        run.settle(call_key, (found.right, (f"agree: {found.first} and {found.second} disagree",)))
        raise check.disagreement(run, found, names)

    def on_host(operands: Any) -> None:
        # Kept where the guard keeps its choices (the ledger), which uninstall() clears: a kernel
        # compared before is compared again after a reinstall.
        if run.settled(key) is not None:
            _findings.hand_over(gate, None)
            return
        run.settle(key, ("agree", ()))
        # Copies: the callback's buffers are the computation's, reused once it returns.
        copied = jax.tree_util.tree_map(lambda x: np.array(x) if isinstance(x, np.ndarray) else x, operands)
        chosen_out, call_args, call_kwargs = copied
        _findings.hand_over(gate, lambda: compare(chosen_out, call_args, call_kwargs))

    def traced_gate(operands: Any) -> Any:
        jax.debug.callback(on_host, operands)
        return np.bool_(False)

    _unless_batched(run, traced_gate, jax.lax.stop_gradient((out, args, kwargs)))  # compared, never differentiated


def _unless_batched(run: Run, gate: Callable[[Any], Any], operands: Any) -> None:
    """``gate(operands)``, traced into the computation; where a `jax.vmap` of the jitted function
    batches the computation after the guard traced it (JAX cannot batch a branch with host
    callbacks), nothing is compared and the decision says so."""
    import numpy as np

    batching_rule_of_our_own = jax_tracing.batching_rule_of_our_own()
    if batching_rule_of_our_own is None:
        gate(operands)
        return
    gated: Any = batching_rule_of_our_own(gate)

    def batched(axis_size: int, in_batched: Any, operands: Any) -> tuple[Any, bool]:
        why = "called under jax.vmap (batched after the guard traced it)"
        note = _checks.unchecked("agree", why, kernel=run.kernel.info, call_site=run.call_site)
        run.ledger.annotate(run.kernel.info, run.call_site, note)
        return np.bool_(False), False

    gated.def_vmap(batched)
    gated(operands)


def _fills(run: Run, names: Sequence[str], outputs: Any) -> dict[str, list[Any]]:
    """What the plain interpreter leaves in an element the kernel never writes, per output
    (``outputs``: arrays or tracers): an element holding it was not written (its own fill is a
    signal, not a value)."""
    import jax

    if "plain" not in names:
        return {}
    dtypes = [str(getattr(leaf, "dtype", "")) for leaf in jax.tree_util.tree_leaves(outputs)]
    with run.ledger.verification():  # the guard's own measuring kernel: no decision of its own
        return {"plain": [plain_fill(dtype) for dtype in dtypes]}


_fill_lock = threading.Lock()
_known_fills: dict[str, Any] = {}


def plain_fill(dtype: str) -> Any:
    """The plain interpreter's fill of an output it never writes, for ``dtype`` on this jax (read
    off a kernel that writes nothing: JAX's choice has changed between versions); None where it
    cannot be read (every element then counts as written)."""
    import jax
    import numpy as np
    from jax.experimental import pallas as pl

    with _fill_lock:
        if dtype in _known_fills:
            return _known_fills[dtype]

    def writes_nothing(o_ref: Any) -> None:
        del o_ref

    fill = None
    try:
        shape: Any = jax.ShapeDtypeStruct
        kernel = pl.pallas_call(writes_nothing, out_shape=shape((1,), dtype), interpret=True)
        out = jax.jit(kernel).lower().compile()()  # computed now, also while a computation is traced
        fill = np.asarray(out)[0]
    except Exception:
        pass
    with _fill_lock:
        _known_fills[dtype] = fill
    return fill


# --- comparing ------------------------------------------------------------------------------------


def leaves(out: Any) -> list[Any]:
    """The outputs as numpy arrays; typed PRNG keys as their key data."""
    import jax
    import numpy as np

    found = []
    for leaf in jax.tree_util.tree_leaves(out):
        found.append(np.asarray(jax.random.key_data(leaf) if _is_key(leaf) else leaf))
    return found


def _is_key(leaf: Any) -> bool:
    import jax

    dtypes: Any = jax.dtypes
    return hasattr(leaf, "dtype") and bool(dtypes.issubdtype(leaf.dtype, dtypes.prng_key))


def compare_outputs(
    outputs: Mapping[str, Sequence[Any]], order: Sequence[str], *, fills: Mapping[str, Sequence[Any]]
) -> Disagreement | None:
    """The first disagreement of ``order[0]`` (the interpreter the guard runs) with another, or of
    any two others; None when all agree on what the kernel wrote. ``fills``: per interpreter and
    output, the value it leaves in an element never written."""
    names = [name for name in order if name in outputs]
    if len(names) < 2:
        return None
    written = _written(outputs, names, fills)
    agrees = {(a, b): _first_difference(outputs[a], outputs[b], written) is None for a in names for b in names}
    for second in names[1:]:
        for first in names[: names.index(second)]:
            found = _first_difference(outputs[first], outputs[second], written)
            if found is None:
                continue
            votes = {n: sum(agrees[n, m] for m in names) for n in names}
            best = max(votes.values())
            leaders = [n for n in names if votes[n] == best]
            agreed = leaders[0] if len(leaders) == 1 and best > len(names) / 2 else None
            right = agreed or ("plain" if "plain" in names else names[0])
            return Disagreement(first, second, *found, right=right, majority=agreed is not None)
    return None


def _written(
    outputs: Mapping[str, Sequence[Any]], names: Sequence[str], fills: Mapping[str, Sequence[Any]]
) -> list[Any | None]:
    """Per output, a mask of the elements the kernel wrote (None: all): those an interpreter with a
    known fill does not hold its fill in."""
    import numpy as np

    masks: list[Any | None] = []
    for position in range(min(len(outputs[n]) for n in names)):
        mask = None
        for name, per_output in fills.items():
            if name not in outputs or position >= len(per_output) or per_output[position] is None:
                continue
            value = outputs[name][position]
            fill = np.asarray(per_output[position], dtype=value.dtype)
            unwritten = _bits(value) == _bits(np.broadcast_to(fill, value.shape))
            mask = ~unwritten if mask is None else mask & ~unwritten
        masks.append(mask)
    return masks


def _first_difference(
    a_values: Sequence[Any], b_values: Sequence[Any], written: Sequence[Any | None]
) -> tuple[int, tuple[int, ...], Any, Any] | None:
    import numpy as np

    for position, (a, b) in enumerate(zip(a_values, b_values, strict=False)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return position, (), f"{a.dtype}{list(a.shape)}", f"{b.dtype}{list(b.shape)}"
        if a.tobytes() == b.tobytes():
            continue
        mask = written[position] if position < len(written) else None
        differs = _bits(a) != _bits(b)
        if _is_float(a.dtype):
            differs &= ~_close(a, b, mask)
        if mask is not None:
            differs &= mask
        where = np.argwhere(differs)
        if len(where):
            index = tuple(int(i) for i in where[0])
            return position, index, _scalar(a[index]), _scalar(b[index])
    return None


def _is_float(dtype: Any) -> bool:
    import numpy as np

    return bool(np.issubdtype(dtype, np.inexact)) or "float" in str(dtype)  # bfloat16, float8: ml_dtypes


def _close(a: Any, b: Any, written: Any | None) -> Any:
    """Elementwise: both NaN (whatever the payloads), equal infinities, or finite and within
    ``float_bound`` of the output's largest finite magnitude among the elements written."""
    import numpy as np

    if np.iscomplexobj(a):
        return _close(a.real, b.real, written) & _close(a.imag, b.imag, written)
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(wide_a) & np.isnan(wide_b)
    finite = np.isfinite(wide_a) & np.isfinite(wide_b)
    counted = finite if written is None else finite & written
    scale = max(float(np.abs(wide_a[counted]).max(initial=0.0)), float(np.abs(wide_b[counted]).max(initial=0.0)))
    near = finite & (np.abs(wide_a - wide_b) <= float_bound(a.dtype, scale))
    return both_nan | near | (wide_a == wide_b)


def _scalar(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def _bits(value: Any) -> Any:
    import numpy as np

    value = np.ascontiguousarray(value)
    width = value.dtype.itemsize
    return value.view(f"u{width}") if width in (1, 2, 4, 8) else value


CHECK = Agree()
