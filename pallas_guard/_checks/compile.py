"""The ``compile`` check: a Mosaic-TPU kernel the guard interprets is also compiled by the TPU's
own compiler (libtpu, deviceless, on the CPU host), for the device setting's TPU generation; a
Triton or Mosaic GPU kernel by XLA's GPU compiler for the device setting's GPU (``gpu_compile``).

JAX's Python lowering is the first of three places a TPU refuses a kernel; libtpu's Mosaic passes
are the second (VMEM exhaustion, vector types a generation cannot load, lane offsets it cannot
prove aligned). libtpu compiles for a topology with no hardware (``_tpu_compile``), so a CPU run
gives the TPU's verdict and the TPU's message. A refusal is a finding that is also an instance of
the error the TPU raises (``MosaicError``, ``JaxRuntimeError`` for resource limits), so a test
that expects the TPU to refuse a kernel passes on a CPU too; a kernel that compiles is silent, and
its decision says what VMEM and SMEM it uses against the generation's limit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pallas_guard._checks import lowering as _lowering_check
from pallas_guard._checks import protocol as _checks
from pallas_guard._deciding import device as _device
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import gpu_compile as _gpu_compile
from pallas_guard._running import tpu_compile as _tpu_compile
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard._vocabulary.record import MemoryUse
from pallas_guard_autoload import DEVICES, device_list, device_slice

if TYPE_CHECKING:
    from pallas_guard._checks.lowering import Target
    from pallas_guard._guard.engine import Run

DEFAULT_GENERATION = "tpu-v5e"


class Compile(_checks.Check):
    name = "compile"
    order = 1
    at_front_door = True

    def before(self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared:
        __tracebackhide__ = True
        target = _lowering_check.target_for(run.kernel.facts.family, _settings.current("device").value)
        if isinstance(target, str) or target.platform not in ("tpu", "cuda"):
            return _checks.Prepared("compile: not checked: not a TPU or GPU kernel (the target's compiler judges it)")
        on_a_gpu = target.platform == "cuda"
        why_not = f"{run.kernel.entry.label} runs when built" if run.kernel.entry.runs_when_applied else None
        why_not = why_not or (_why_not_on_a_gpu(run) if on_a_gpu else _why_not_on_a_tpu(run))
        if why_not is not None:
            return _checks.Prepared(
                _checks.unchecked(self.name, why_not, kernel=run.kernel.info, call_site=run.call_site)
            )
        return self.before_gpu(run, target, args, kwargs) if on_a_gpu else self.before_tpu(run, target, args, kwargs)

    def before_tpu(self, run: Run, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared:
        __tracebackhide__ = True
        # Inside shard_map: compiled in the program a pod slice of the mesh's shape would run.
        called_in = run.called_in()
        mesh = _tpu_compile.Mesh(*called_in) if called_in else None
        setting = _settings.current("device").value
        compiling = [
            _tpu_compile.start_compile(
                run.kernel.build, args, kwargs, generation, mesh=mesh, named=device_slice(setting, generation)
            )
            for generation in _generations(setting)
        ]
        if all(each.ready for each in compiling):  # known already: a refusal never runs the kernel
            return self.verdict(run, target, [each.outcome() for each in compiling], mesh)
        # libtpu compiles beside the interpreted run; the engine asks for the verdict after it (under
        # a jit call, just before the program runs).
        return _checks.Prepared(pending=lambda: self.verdict(run, target, [each.outcome() for each in compiling], mesh))

    def verdict(
        self, run: Run, target: Target, outcomes: list[_tpu_compile.Outcome], mesh: _tpu_compile.Mesh | None
    ) -> _checks.Prepared:
        """The compiler's outcomes for each generation as the check's note and figures, or its finding."""
        __tracebackhide__ = True
        compiled: dict[str, str] = {}  # generation (and topology) -> its usage
        refused: dict[str, _tpu_compile.Outcome] = {}
        memory: list[MemoryUse] = []
        for outcome in outcomes:
            label = _label(outcome.generation, mesh)
            if outcome.unchecked is not None:
                why = f"for {label}: {outcome.unchecked}"
                note = f"compile: not checked {why}"
                return _checks.Prepared(
                    _checks.unchecked(self.name, why, kernel=run.kernel.info, call_site=run.call_site, note=note)
                )
            figures = memory_use(outcome)
            memory.extend(figures)
            if outcome.error is None:
                compiled[label] = usage(figures, cached=outcome.cached)
            else:
                refused[label] = outcome
        memory.sort(key=lambda use: -use.share)
        if not refused:
            _within_headroom(run, tuple(memory))
            note = "compile: compiles for " + "; ".join(f"{g}{use}" for g, use in compiled.items())
            return _checks.Prepared(note, memory=tuple(memory))
        label, first = next(iter(refused.items()))
        generation, refusal = first.generation, first.error
        assert refusal is not None
        source = target.source if generation == target.device else "the device setting"
        if compiled:  # which generations it does compile for: the refusal is this generation's
            source += f"; it compiles for {_and(list(compiled))}"
        if len(refused) > 1:
            source += f"; {_and(list(refused)[1:])} {'refuses' if len(refused) == 2 else 'refuse'} it too"
        fix = _diagnostics.refusal_fix(
            refusal, target=generation, vmem_capacity=_capacity(generation), windows=first.windows
        )
        error = _diagnostics.lowering_refused(
            kernel=run.kernel.info,
            call_site=run.call_site,
            target=f"{label} ({source})",
            error=refusal,
            fix=fix,
            source=_settings.stated("checks"),
            check=self.name,
        )
        finding = as_the_targets(error, refusal)
        raise _checks.found(
            self.name, finding, kernel=run.kernel.info, call_site=run.call_site, memory=tuple(memory)
        ) from None

    # --- a GPU kernel: XLA's GPU compiler, for each GPU the device setting names --------------------

    def before_gpu(self, run: Run, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared:
        __tracebackhide__ = True
        setting = _settings.current("device").value
        gpus = [device for device in device_list(setting) if DEVICES[device][2] == "gpu"] or [target.device]
        # Under vmap, the kernel its batching rule makes; lowered without values, as the lowering check does.
        kernel = run.kernel.build()
        if not kwargs:
            kernel, args = jax_tracing.as_vmap_calls_it(kernel, args)
        avals, kwavals = _lowering_check.shapes_of((args, kwargs))
        compiling = []
        for gpu in gpus:
            # Lowered as for that GPU: Triton's lowering reads the compute capability of the device
            # in scope (jax 0.12), which a CPU host has none of.
            with _device.presented(gpu):
                compiling.append(_gpu_compile.start_compile(kernel, avals, kwavals, gpu))
        if all(each.ready for each in compiling):
            return self.gpu_verdict(run, target, [each.outcome() for each in compiling])
        return _checks.Prepared(pending=lambda: self.gpu_verdict(run, target, [each.outcome() for each in compiling]))

    def gpu_verdict(self, run: Run, target: Target, outcomes: list[_gpu_compile.Outcome]) -> _checks.Prepared:
        """XLA's outcomes for each GPU as the check's note, or its finding."""
        __tracebackhide__ = True
        for outcome in outcomes:
            if outcome.unchecked is not None:
                why = f"for {outcome.gpu}: {outcome.unchecked}"
                note = f"compile: not checked {why}"
                return _checks.Prepared(
                    _checks.unchecked(self.name, why, kernel=run.kernel.info, call_site=run.call_site, note=note)
                )
        refused = [outcome for outcome in outcomes if outcome.error_type is not None]
        compiled = [outcome for outcome in outcomes if outcome.error_type is None]
        if not refused:
            uses = {outcome.gpu: gpu_memory_use(outcome) for outcome in compiled}
            memory = sorted((use for each in uses.values() for use in each), key=lambda use: -use.share)
            _within_headroom(run, tuple(memory))
            parts = [f"{o.gpu}{usage(uses[o.gpu], cached=o.cached, seconds=o.seconds)}" for o in compiled]
            return _checks.Prepared("compile: compiles for " + "; ".join(parts), memory=tuple(memory))
        first = refused[0]
        source = target.source if first.gpu == target.device else "the device setting"
        if compiled:
            source += f"; it compiles for {_and([o.gpu for o in compiled])}"
        if len(refused) > 1:
            others = [o.gpu for o in refused[1:]]
            source += f"; {_and(others)} {'refuses' if len(others) == 1 else 'refuse'} it too"
        refusal = first.lowering or _gpu_refusal(first)
        error = _diagnostics.lowering_refused(
            kernel=run.kernel.info,
            call_site=run.call_site,
            target=f"{first.gpu} ({source})",
            error=refusal,
            fix=_diagnostics.gpu_refusal_fix(str(refusal), _gpu_compile.TARGETS[first.gpu], first.gpu),
            source=_settings.stated("checks"),
            check=self.name,
            step="JAX's lowering for CUDA (before XLA's GPU compiler)" if first.lowering else "XLA's GPU compile",
        )
        raise _checks.found(self.name, as_the_targets(error, refusal), kernel=run.kernel.info, call_site=run.call_site)


def _why_not_on_a_tpu(run: Run) -> str | None:
    aborting = _aborting_memory_space(run.kernel.kwargs)
    if aborting is not None:
        return f"libtpu aborts the process on {aborting} operands"
    return _tpu_compile.available()


def _why_not_on_a_gpu(run: Run) -> str | None:
    if run.called_in():
        return "a kernel inside shard_map is not compiled for a GPU (one GPU is described)"
    return _gpu_compile.available()


def _gpu_refusal(outcome: _gpu_compile.Outcome) -> BaseException:
    """The refusal the child process reported, as the exception type the GPU's compile raises
    where it raises one (``JaxRuntimeError``, ``ValueError``); a fatal error has none."""
    import jax

    types: dict[str, type[BaseException]] = {"JaxRuntimeError": jax.errors.JaxRuntimeError, "ValueError": ValueError}
    types["XlaRuntimeError"] = types["JaxRuntimeError"]
    cls = types.get(outcome.error_type or "", GpuCompilerError)
    return cls(outcome.message or "")


class GpuCompilerError(Exception):
    """A refusal that ended XLA's GPU compiler's process (an LLVM fatal error), or of a type the guard
    does not recreate: its text is the compiler's."""


def _label(generation: str, mesh: _tpu_compile.Mesh | None) -> str:
    """``tpu-v5e``, or ``tpu-v5e (v5e:2x2, per shard of a mesh x=4)`` inside ``shard_map``."""
    if mesh is None or mesh.devices == 1:
        return generation
    named = device_slice(_settings.current("device").value, generation)
    topology = _tpu_compile.topology_for(generation, mesh.devices, named)
    return f"{generation} ({topology[0]}, per shard of a mesh {mesh})" if isinstance(topology, tuple) else generation


def _generations(setting: str | None) -> list[str]:
    """The TPU generations to compile for: every one the device setting lists, else the default."""
    listed = [device for device in device_list(setting) if device in _tpu_compile.GENERATIONS]
    return listed or [DEFAULT_GENERATION]


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _aborting_memory_space(kwargs: dict[str, Any]) -> str | None:
    """A memory space of the kernel's operands that libtpu 0.0.42 refuses by aborting the whole
    process (a fatal check, not an error), seen on JAX's own TPU tests: host memory, a semaphore
    output. Such a kernel is not compiled in this process."""
    import jax

    specs = [kwargs.get(name) for name in ("in_specs", "out_specs", "out_shape")]
    grid_spec = kwargs.get("grid_spec")
    specs += [getattr(grid_spec, name, None) for name in ("in_specs", "out_specs")]
    for leaf in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: hasattr(x, "memory_space")):
        space = str(getattr(leaf, "memory_space", "") or "").lower()
        for word in ("host", "semaphore", "sflag"):
            if word in space:
                return space
    return None


def memory_use(outcome: _tpu_compile.Outcome) -> list[MemoryUse]:
    """What the compiler said the kernel takes of ``outcome.generation``'s memories: its figures
    where it compiled, the refusal's where it was refused."""
    generation, compiled = outcome.generation, outcome.error is None
    if not compiled:
        figures = _diagnostics.refused_memory(outcome.error)  # type: ignore[arg-type]
        return [MemoryUse(generation, space, used, limit, compiled=False) for space, used, limit in figures]
    uses = []
    if outcome.vmem_used is not None and outcome.vmem_limit:
        uses.append(MemoryUse(generation, "VMEM", outcome.vmem_used, outcome.vmem_limit, compiled=True))
    spec = _tpu_compile.GENERATIONS.get(generation)
    if outcome.vmem_scratch and spec is not None:
        uses.append(MemoryUse(generation, "VMEM scratch", outcome.vmem_scratch, spec.vmem_capacity, compiled=True))
    if outcome.smem_used is not None and outcome.smem_limit:
        uses.append(MemoryUse(generation, "SMEM", outcome.smem_used, outcome.smem_limit, compiled=True))
    return uses


def gpu_memory_use(outcome: _gpu_compile.Outcome) -> list[MemoryUse]:
    """What XLA's compile and ptxas said a kernel that compiled spends of ``outcome.gpu``: shared
    memory, registers per thread, and spills where there are any."""
    figures, spec = outcome.figures, _gpu_compile.TARGETS.get(outcome.gpu)
    if figures is None or spec is None:
        return []
    uses = []
    if figures.shared_memory is not None:
        uses.append(
            MemoryUse(outcome.gpu, "shared memory", figures.shared_memory, spec.shared_memory_per_block_optin, True)
        )
    if figures.registers is not None:
        uses.append(MemoryUse(outcome.gpu, "registers", figures.registers, spec.registers_per_thread, True))
    if figures.spill_stores:
        uses.append(MemoryUse(outcome.gpu, "spill stores", figures.spill_stores, 0, True))
    return uses


def usage(figures: list[MemoryUse], *, cached: bool = False, seconds: float | None = None) -> str:
    """``: VMEM 1.0 MiB of 16.0 MiB (6%), SMEM 8 B of 1.0 MiB (0%)`` where the compiler said; how
    long the compile took where it is given (``seconds``: GPU compiles, whose ptxas is the long pole)."""
    kept = " (cached: an earlier run compiled it)" if cached else ""
    if seconds is not None and not cached:
        kept = f" ({COMPILE_TOOK.format(seconds=seconds)})"
    return f": {', '.join(map(str, figures))}{kept}" if figures else kept


COMPILE_TOOK = "XLA's compile: {seconds:.1f} s"
"""How long a GPU compile took, in its note: the pytest plugin's slowest list reads it back."""


def _within_headroom(run: Run, memory: tuple[MemoryUse, ...]) -> None:
    """A kernel that compiles but leaves less of a VMEM or shared-memory limit free than the
    headroom setting asks, or spills registers, is a finding: a small change of shapes, of the
    compiler or of the chip refuses it (or, for a spill, slows it)."""
    __tracebackhide__ = True
    headroom = _settings.current("vmem_headroom")
    if not headroom.value:
        return
    tight = [use for use in memory if use.space in _HELD_TO_HEADROOM and use.share > 1 - headroom.value]
    if not tight:
        return
    first = tight[0]
    if first.space in ("shared memory", "spill stores"):
        fix = _diagnostics.gpu_tight_fix(first.space, first.generation)
    else:
        fix = _diagnostics.tight_fix(first.space, first.generation, vmem_capacity=_capacity(first.generation))
    error = _diagnostics.too_tight(
        kernel=run.kernel.info,
        call_site=run.call_site,
        uses=[str(use) + f" on {use.generation}" for use in tight],
        headroom=_settings.stated("vmem_headroom"),
        fix=fix,
    )
    raise _checks.found("compile", error, kernel=run.kernel.info, call_site=run.call_site, memory=memory)


_HELD_TO_HEADROOM = ("VMEM", "VMEM scratch", "shared memory", "spill stores")
"""SMEM is left out (its figure is an estimate), registers too (a spill is what a limit costs)."""


def _capacity(generation: str) -> int | None:
    spec = _tpu_compile.GENERATIONS.get(generation)
    return spec.vmem_capacity if spec else None


def as_the_targets(finding: PallasGuardError, refusal: BaseException) -> PallasGuardError:
    """``finding`` as an instance of both ``PallasGuardError`` and the type the TPU raised (where
    Python allows the two as bases), so that ``except MosaicError`` catches it as on the chip."""
    cls = _both(type(refusal))  # type: ignore[arg-type]
    if cls is PallasGuardError:
        return finding
    both = cls(*finding.args)
    both.__dict__.update(getattr(finding, "__dict__", {}))
    return both


@functools.cache
def _both(refused: type[BaseException]) -> type[PallasGuardError]:
    if issubclass(refused, PallasGuardError) or not issubclass(refused, Exception):
        return PallasGuardError
    try:
        # The message is ours: the refusal's own __init__/__str__ (JaxRuntimeError's are C++ ones
        # that read fields of their own) are not asked for it.
        namespace = {"__module__": "pallas_guard", "__init__": Exception.__init__, "__str__": Exception.__str__}
        cls: type[PallasGuardError] = type("PallasGuardError", (PallasGuardError, refused), namespace)
    except TypeError:  # a base Python cannot combine with ValueError's layout
        return PallasGuardError
    cls.__qualname__ = f"PallasGuardError[{refused.__qualname__}]"
    return cls


CHECK = Compile()
