"""Locating JAX's interpreters across versions, and choosing one for a kernel.

Measured on JAX's own shipped kernels: the plain interpreter (``interpret=True``) runs every Triton
kernel and the single-device Mosaic-TPU kernels (manual DMAs, DMA semaphores, scalar prefetch)
correctly and 10-400x faster than TPU interpret mode; TPU interpret mode is needed only for
cross-device semantics (remote DMAs, device ids, barrier semaphores), and there only with eager DMA
execution; Mosaic-GPU kernels run only in the Mosaic-GPU interpreter. So: plain unless the kernel's
facts say otherwise. The facts are read without tracing the body: the backend from the defining
module of ``compiler_params``/mesh/grid spec/scratch types, and the names the body's code uses.
"""

from __future__ import annotations

import functools
import linecache
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state
from pallas_guard._vocabulary.enums import Interpreter
from pallas_guard._vocabulary.settings import Setting
from pallas_guard_autoload import CHECKS_ENV


class KernelFacts(NamedTuple):
    """What the guard knows about a kernel before its body is traced."""

    family: str | None
    """``"mosaic_tpu"``, ``"mosaic_gpu"``, ``"triton"``, or None (nothing backend-specific)."""
    family_evidence: str
    cross_device: str | None
    """Why the kernel needs cross-device TPU semantics, or None."""
    core_mesh: str | None = None
    """The TPU core mesh the kernel is mapped over (``pl.kernel``/``core_map``), or None."""
    program_id_in_control_flow: str | None = None
    """Where the body reads ``program_id`` below its top level (``pl.when``, ``fori_loop``), or None."""
    entry_point: str = "pallas_call"
    captured_refs: str | None = None
    """The refs the body captures (partial arguments, closure: ``pl.run_state``), or None."""
    plain_risk: str | None = None
    """What in a Mosaic-TPU kernel the plain interpreter may not lower (DMAs, semaphores, memory
    spaces, scalar prefetch, TPU primitives, a jitted body), or None: block specs and vector code."""
    whole_windows_over_grid: str | None = None
    """A ``pallas_call`` whose grid has more than one step and whose block specs all address
    whole arrays (no block shape: ``plgpu.GMEM`` refs), or None."""
    draws_random_bits: str | None = None
    """Where the body draws from the TPU's generator (``pltpu.prng_random_bits``, the
    ``stateful_*`` samplers), or None."""
    host_memory: str | None = None
    """An operand in host memory (``pl.HOST``, ``pltpu.HOST``), or None."""
    revisits_outputs: str | None = None
    """An output block spec that lets any later grid step revisit its block
    (``pl.Buffered(..., revisit=pl.RevisitMode.ANY)``), or None."""


GENERIC = KernelFacts(None, "no backend-specific compiler_params, mesh, grid spec or scratch types", None)


class Candidates(NamedTuple):
    """The interpreters that may run one kernel, best first, and whether to verify the first."""

    names: tuple[str, ...]
    """``"plain"``, ``"tpu"``, ``"gpu"``, in the order to try them."""
    reason: str
    verify: bool = False
    """The facts are ambiguous: check the first candidate (a trial lowering) before committing."""
    detect_races: bool = False
    """The interpreter's race detector on: a race is reported as ``PallasGuardError``."""
    checked: frozenset[str] = frozenset()
    """The checks (``races``, ``bounds``) the chosen interpreter applies."""
    checks_note: str | None = None
    """What the checks asked for mean for this kernel, for a warning: that they cannot apply, and
    why; or that they chose an interpreter much slower than the one it would run in unchecked."""
    lacking: bool = False
    """An interpreter the facts call for is missing in this jax: the front door still wraps the
    kernel, to explain its failure."""
    eager_dmas: bool = False
    """TPU interpret mode with eager DMA execution (cross-device kernels)."""
    note: str | None = None
    """What the answer of the interpreter chosen is not (a TPU's random bits), for the decision."""
    at_front_door: bool = False
    """A check in force acts at the call (it lowers or compiles the kernel for its target, or runs
    it in every interpreter): the front door acts under any trace."""


PLAIN_ONLY = Candidates(("plain",), "the plain interpreter runs single-device kernels correctly and fastest")


# --- kernel facts ---------------------------------------------------------------------------------

# Names a kernel body uses only for cross-device TPU semantics the plain interpreter cannot run.
_CROSS_DEVICE_NAMES = frozenset({"async_remote_copy", "make_async_remote_copy", "get_barrier_semaphore"})
# A keyword argument that addresses another device (semaphore_signal(..., device_id=...), remote DMAs).
_CROSS_DEVICE_KEYWORDS = frozenset({"device_id"})
_MAX_CODE_OBJECTS = 64  # nested functions scanned per body: bounded, so the front door stays cheap


def _leaves(tree: object, depth: int = 0) -> Iterator[object]:
    """Leaves of nested tuples/lists/dicts (scratch shapes), without importing jax."""
    if depth > 8:
        return
    if isinstance(tree, Mapping):
        for value in tree.values():
            yield from _leaves(value, depth + 1)
    elif isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        for value in tree:
            yield from _leaves(value, depth + 1)
    else:
        yield tree


def _is_barrier(leaf: object) -> bool:
    for candidate in (leaf, getattr(leaf, "type", None), getattr(leaf, "dtype", None)):
        if getattr(candidate, "name", None) == "BARRIER" or "BARRIER" in type(candidate).__name__.upper():
            return True
    return False


def innermost_function(body: object) -> Any:
    """The Python function behind a kernel body: through partials, decorators (``__wrapped__``,
    jitted functions), bound methods and callable objects (their ``__call__``)."""
    function = body
    for _ in range(16):  # a bounded unwrap: a self-referencing __wrapped__ cannot loop
        if isinstance(function, functools.partial):
            function = function.func
        elif getattr(function, "__wrapped__", None) is not None:
            function = function.__wrapped__  # type: ignore[attr-defined]
        elif isinstance(function, types.MethodType):
            function = function.__func__
        elif not hasattr(function, "__code__") and callable(function) and not isinstance(function, type):
            call = getattr(type(function), "__call__", None)  # noqa: B004 - the class's, not an instance attribute
            if call is None or not hasattr(call, "__code__"):
                break
            function = call
        else:
            break
    return function


def code_objects(body: object, *, helpers: bool = False) -> Iterator[types.CodeType]:
    """The body's code, then its nested functions' (``pl.when`` bodies, loop bodies, lambdas); with
    ``helpers``, also the code of module-level functions of the body's own module that they call."""
    function = innermost_function(body)
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", None) or {}
    module = namespace.get("__name__")
    pending = [code] if isinstance(code, types.CodeType) else []
    seen: set[types.CodeType] = set()
    while pending and len(seen) < _MAX_CODE_OBJECTS:
        code = pending.pop(0)
        if code in seen:
            continue
        seen.add(code)
        yield code
        pending.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
        if helpers:
            for name in code.co_names:
                helper = namespace.get(name)
                if isinstance(helper, types.FunctionType) and helper.__module__ == module:
                    pending.append(helper.__code__)


def _body_cross_device(body: object) -> str | None:
    for code in code_objects(body):
        names = _CROSS_DEVICE_NAMES.intersection(code.co_names)
        if names:
            return f"its body calls {', '.join(sorted(names))}"
        # Keyword-argument names of calls are stored as tuples of str constants.
        for const in code.co_consts:
            if isinstance(const, tuple) and _CROSS_DEVICE_KEYWORDS.intersection(c for c in const if isinstance(c, str)):
                return "its body addresses another device (device_id=)"
    return None


_GRID_NAMES = frozenset({"program_id", "num_programs"})


def _program_id_in_control_flow(body: object) -> str | None:
    """A nested function of the body (a ``pl.when``/``cond``/loop body), or a helper of its module,
    that reads the grid position: where the plain interpreter may not substitute it."""
    codes = code_objects(body, helpers=True)
    if not _under_jit(body):
        next(codes, None)  # the body's own top level: the plain interpreter handles it there
    for code in codes:
        if _GRID_NAMES.intersection(code.co_names):
            return f"{code.co_name} reads {', '.join(sorted(_GRID_NAMES.intersection(code.co_names)))}"
    return None


def _under_jit(body: object) -> bool:
    """Whether the body, or a wrapper on the way to its function, is a ``jax.jit``: its whole code
    then runs inside a nested jaxpr of the traced kernel, not at the kernel's top level."""
    function = body
    for _ in range(16):
        if callable(getattr(function, "lower", None)) and callable(getattr(function, "trace", None)):
            return True
        if isinstance(function, functools.partial):
            function = function.func
        elif getattr(function, "__wrapped__", None) is not None:
            function = function.__wrapped__  # type: ignore[attr-defined]
        else:
            return False
    return False


def kernel_facts(entry_point: str, body: object, kwargs: Mapping[str, Any], mesh: object = None) -> KernelFacts:
    """Facts about one kernel from the entry point's arguments; never traces the body."""
    family: str | None = "mosaic_gpu" if entry_point == "plgpu.kernel" else None
    evidence = "built with plgpu.kernel" if family else ""
    compiler_params = kwargs.get("compiler_params")
    params_objects = list(compiler_params.values()) if isinstance(compiler_params, Mapping) else [compiler_params]
    if isinstance(compiler_params, Mapping):
        for key in compiler_params:
            family = family or jax_pallas.backend_family(str(key))
    grid_spec = kwargs.get("grid_spec")
    scratch = [kwargs.get("scratch_shapes"), kwargs.get("scratch_types"), getattr(grid_spec, "scratch_shapes", None)]
    mesh = mesh if mesh is not None else kwargs.get("mesh")
    sources: list[tuple[str, object]] = [("compiler_params", p) for p in params_objects if p is not None]
    sources += [("mesh", mesh), ("grid_spec", grid_spec), ("backend", kwargs.get("backend"))]
    # A block spec's memory space (pltpu.HBM, pltpu.SMEM, ...) says which hardware it was written for.
    sources += [("block spec memory space", space) for space in _block_spec_spaces(kwargs)]
    # A scratch shape's own type may be generic (pallas core); its memory space or dtype is not.
    sources += [
        ("scratch shapes", part)
        for leaf in _leaves(scratch)
        for part in (leaf, getattr(leaf, "memory_space", None), getattr(leaf, "dtype", None))
    ]
    for label, obj in sources:
        if family is not None:
            break
        found = jax_pallas.backend_family(obj) if obj is not None else None
        if found is not None:
            family = found
            evidence = f"{label} {type(obj).__name__ if not isinstance(obj, str) else repr(obj)} is {found}"
    cross_device = None
    if family in (None, "mosaic_tpu"):
        collective_ids = [getattr(p, "collective_id", None) for p in params_objects if p is not None]
        if any(c is not None for c in collective_ids):
            cross_device = "its TPU compiler_params set collective_id (a barrier semaphore across devices)"
        elif any(_is_barrier(leaf) for leaf in _leaves(scratch)):
            cross_device = "it allocates a BARRIER semaphore"
        else:
            cross_device = _body_cross_device(body)
    core_mesh = next(
        (type(m).__name__ for m in _leaves(mesh) if m is not None and jax_pallas.backend_family(m) == "mosaic_tpu"),
        None,
    )
    program_id = _program_id_in_control_flow(body)
    return KernelFacts(
        family,
        evidence or GENERIC.family_evidence,
        cross_device,
        core_mesh,
        program_id,
        entry_point,
        _captured_refs(body),
        _plain_risk(body, kwargs, scratch) if family == "mosaic_tpu" else None,
        _whole_windows_over_grid(entry_point, kwargs),
        _draws_random_bits(body),
        _host_memory(kwargs),
        _revisits_outputs(kwargs),
    )


def _revisits_outputs(kwargs: Mapping[str, Any]) -> str | None:
    grid_spec = kwargs.get("grid_spec")
    for spec in _leaves([kwargs.get("out_specs"), getattr(grid_spec, "out_specs", None)]):
        revisit = getattr(getattr(spec, "pipeline_mode", None), "revisit", None)
        if str(getattr(revisit, "name", revisit or "")).upper() == "ANY":
            return "an output block spec revisits its block at any step (revisit=pl.RevisitMode.ANY)"
    return None


def _host_memory(kwargs: Mapping[str, Any]) -> str | None:
    word = _space_named(_block_spec_spaces(kwargs), ("HOST",))
    return f"an operand in memory space {word}" if word else None


def _space_named(spaces: list[object], words: tuple[str, ...]) -> str | None:
    """The first memory space whose name contains one of ``words`` (upper case), as named."""
    for space in spaces:
        name = str(getattr(space, "name", space)).upper()
        if space is not None and any(word in name for word in words):
            return name
    return None


def _names_used(body: object, names: frozenset[str], verb: str) -> str | None:
    """``"<function> <verb> <names>"`` for the first function of the body (helpers included) whose
    code names one of ``names``, or None."""
    for code in code_objects(body, helpers=True):
        used = names.intersection(code.co_names)
        if used:
            return f"{code.co_name} {verb} {', '.join(sorted(used))}"
    return None


_RANDOM_BITS_NAMES = frozenset({"prng_random_bits", "stateful_uniform", "stateful_normal", "stateful_bits"})


def _draws_random_bits(body: object) -> str | None:
    return _names_used(body, _RANDOM_BITS_NAMES, "draws with")


def _whole_windows_over_grid(entry_point: str, kwargs: Mapping[str, Any]) -> str | None:
    """The Mosaic-GPU interpreter accepts only whole-array windows; over a grid of several steps it
    then runs (and gets the grid wrong, see ``GETS_WRONG``). Other windows it refuses at lowering."""
    grid_spec = kwargs.get("grid_spec")
    grid = kwargs.get("grid")
    grid = grid if grid is not None else getattr(grid_spec, "grid", None)
    grid = (grid,) if isinstance(grid, int) else grid
    if entry_point != "pallas_call" or not isinstance(grid, tuple | list):
        return None
    steps = 1
    for size in grid:
        steps *= size if isinstance(size, int) else 2  # a dynamic size may be more than one
    specs = [kwargs.get("in_specs"), kwargs.get("out_specs")]
    specs += [getattr(grid_spec, "in_specs", None), getattr(grid_spec, "out_specs", None)]
    if steps < 2 or any(getattr(spec, "block_shape", None) is not None for spec in _leaves(specs)):
        return None
    return f"its grid {tuple(grid)} has more than one step over whole-array windows"


# What a Mosaic-TPU kernel uses that the plain interpreter lowers through discharge rules with gaps
# (DMAs with transforms, semaphores, memory spaces) or may not lower at all (TPU-only primitives).
# Without any of it, a kernel is block specs and vector code: JAX's own interpret=True mode.
_PLAIN_RISKY_NAMES = frozenset(
    {
        "async_copy", "make_async_copy", "sync_copy", "make_async_remote_copy", "async_remote_copy",
        "dma_start", "dma_wait", "semaphore_signal", "semaphore_wait", "semaphore_read", "run_scoped",
        "emit_pipeline", "emit_pipeline_with_allocations", "bitcast", "roll", "repeat", "prng_seed",
        "prng_random_bits", "stateful_uniform", "stateful_normal", "stateful_bits", "delay", "core_barrier",
        "get_barrier_semaphore", "with_memory_space_constraint", "load_expanded", "store_compressed",
    }
)  # fmt: skip
_PLAIN_RISKY_SPACES = ("ANY", "HBM", "SEMAPHORE", "HOST")  # DMA territory; SMEM and VMEM are arrays


def _block_spec_spaces(kwargs: Mapping[str, Any]) -> list[object]:
    """The memory spaces of the kernel's block specs (given directly or in its grid spec)."""
    grid_spec = kwargs.get("grid_spec")
    specs = [kwargs.get("in_specs"), kwargs.get("out_specs")]
    specs += [getattr(grid_spec, "in_specs", None), getattr(grid_spec, "out_specs", None)]
    return [getattr(leaf, "memory_space", None) for leaf in _leaves(specs)]


def _plain_risk(body: object, kwargs: Mapping[str, Any], scratch: object) -> str | None:
    """Why the plain interpreter may not lower this Mosaic-TPU kernel (then it is verified)."""
    if _under_jit(body):
        return "its body is a jax.jit function"
    spaces = _block_spec_spaces(kwargs)
    for leaf in _leaves(scratch):
        if _is_semaphore(leaf):
            return "it allocates a semaphore"
        spaces.append(getattr(leaf, "memory_space", None))
    word = _space_named(spaces, _PLAIN_RISKY_SPACES)
    if word:
        return f"it uses memory space {word}"
    uses = _names_used(body, _PLAIN_RISKY_NAMES, "uses")
    if uses:
        return uses
    nested = _program_id_nested(body)
    return f"program_id inside control flow ({nested})" if nested else None


_COMPREHENSIONS = frozenset({"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"})


def _program_id_nested(body: object) -> str | None:
    """A function nested in the body or in a helper of its module (a ``pl.when``/``cond``/loop
    body) that reads the grid position; a helper's own top level runs at the kernel's."""
    tops = {getattr(innermost_function(body), "__code__", None)}
    function = innermost_function(body)
    namespace = getattr(function, "__globals__", None) or {}
    tops.update(
        getattr(value, "__code__", None) for value in namespace.values() if isinstance(value, types.FunctionType)
    )
    for code in code_objects(body, helpers=True):
        if code in tops or code.co_name in _COMPREHENSIONS:  # a comprehension runs where it stands
            continue
        if _GRID_NAMES.intersection(code.co_names):
            return f"{code.co_name} reads {', '.join(sorted(_GRID_NAMES.intersection(code.co_names)))}"
    return None


def _is_semaphore(leaf: object) -> bool:
    return any("SEMAPHORE" in type(part).__name__.upper() for part in (leaf, getattr(leaf, "dtype", None)))


def _captured_refs(body: object) -> str | None:
    """The refs a body captures through partial arguments or its closure (``pl.run_state``)."""
    captured: list[object] = []
    function = body
    for _ in range(16):
        if isinstance(function, functools.partial):
            captured += [*function.args, *function.keywords.values()]
            function = function.func
        elif getattr(function, "__wrapped__", None) is not None:
            function = function.__wrapped__  # type: ignore[attr-defined]
        else:
            break
    captured += [cell.cell_contents for cell in getattr(function, "__closure__", None) or () if _filled(cell)]
    refs = sum(1 for value in captured if jax_state.is_state_ref(value))
    return f"its body captures {refs} ref{'s' if refs > 1 else ''} (pl.run_state)" if refs else None


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


class Gap(NamedTuple):
    """Something an interpreter gets wrong: it runs the kernel and the answer is wrong, or it fails
    on a kernel another interpreter runs right."""

    interpreter: str
    """``"plain"``, ``"tpu"`` or ``"gpu"``."""
    fact: str
    """The ``KernelFacts`` field that detects such a kernel."""
    wrong: str
    """What the interpreter gets wrong."""
    below: tuple[int, ...] | None
    """The jax releases it applies to: below this one (None: every supported release)."""
    seen: str
    """Where it was seen: the kernel in the tests that shows it, and the jax versions run."""


GETS_WRONG = (
    Gap(
        "plain",
        "captured_refs",
        "drops the writes a kernel makes to refs it captures",
        (0, 11, 2),  # 0.11.0 and 0.11.1 unmeasured: the correct interpreter, not the fast one
        "tests/test_right_answers.py: a DMA copy into a ref captured through pl.run_state returns zeros in "
        "jax 0.7.2 and 0.10.2 (1023 of 1024 elements wrong); right in 0.11.2 and 0.12.0.1",
    ),
    Gap(
        "tpu",
        "draws_random_bits",
        "returns zeros for every pltpu.prng_random_bits",
        None,
        "tests/test_tpu_rules.py: pltpu.prng_random_bits of a seeded kernel is all zeros in TPU interpret mode "
        "in jax 0.10.2 and 0.12.0.1 (its rule is a TODO there); the plain interpreter draws with the guard's rule",
    ),
    Gap(
        "tpu",
        "host_memory",
        "fails on it (KeyError: MemorySpace.HOST, or a safe_zip() length error) where the plain interpreter runs it",
        None,
        "tests/test_interpreter_choice.py: a DMA from HBM into a pl.HOST output, jitted with a pinned_host output "
        "sharding (JAX's test_hbm_to_host_host_output_dma), in jax 0.10.2 (0.12.0.1 builds such outputs otherwise)",
    ),
    Gap(
        "tpu",
        "revisits_outputs",
        "refuses it as it runs ('Revisited block ... of output 0'), though a TPU runs it",
        None,
        "tests/test_interpreter_choice.py: JAX's test_block_reduction_with_non_immediate_revisit kernel (an "
        "accumulator over a (3, 3) grid, revisit=ANY), in jax 0.10.2 and 0.12.0.1; the plain interpreter is exact",
    ),
    Gap(
        "gpu",
        "whole_windows_over_grid",
        "runs every step of a pallas_call's grid as program 0 (the rest of the output is never written: NaN)",
        None,
        "tests/test_right_answers.py: o_ref[i, :] = x_ref[i, :] * 2 over GMEM refs with a grid of 2 computes "
        "row 0 only, the other row NaN, in jax 0.10.2 and 0.12.0.1 (the plain interpreter is exact)",
    ),
)
"""What each interpreter gets wrong: a kernel with such a fact never runs in that interpreter."""


def gets_wrong(interpreter: str, facts: KernelFacts) -> str | None:
    """Why ``interpreter`` would return a wrong answer for this kernel on this jax, or None."""
    release = jax_lookup.jax_release()
    for gap in GETS_WRONG:
        detected = getattr(facts, gap.fact) if gap.interpreter == interpreter else None
        if detected and (gap.below is None or not release or release < gap.below):
            who = describe_interpreter(gap.interpreter)
            return f"{detected}, and {who} {gap.wrong} in jax {jax_lookup.jax_version()}"
    return None


def plain_gets_wrong(facts: KernelFacts) -> str | None:
    return gets_wrong("plain", facts)


# --- the choice ---------------------------------------------------------------------------------


def candidates(
    setting: Setting[Interpreter],
    facts: KernelFacts = GENERIC,
    *,
    checks: frozenset[str] = frozenset(),
    checks_from: str = CHECKS_ENV,
    effects_refused: str | None = None,
) -> Candidates:
    """The interpreters for one kernel, best first: the user's forced one, else by the kernel's facts.

    The order and what is verified come from measurements on JAX's own kernels and on third-party
    libraries (README, "How the interpreter is chosen"). ``checks`` (races, bounds) keep a kernel
    where it runs unchecked: the plain interpreter makes both itself; TPU interpret mode (chosen, or
    forced) and the Mosaic-GPU interpreter run with their race detectors on. A kernel whose
    interpreter cannot check races runs unchecked (``Candidates.checks_note`` says why).
    """
    # An interpreter's checks; the others are the engine's (comparing interpreters, lowering and
    # compiling for the kernel's target).
    checks = checks & {"races", "bounds"}
    bounds = frozenset(checks & {"bounds"})  # every interpreter checks bounds: see below
    if effects_refused is not None:
        # TPU/GPU params add ordered effects, whose tokens this place has no room for (KeyError:
        # OrderedIOEffect at the outer lowering); the net's plain interpreter adds none.
        chosen = PLAIN_ONLY._replace(
            reason=f"{effects_refused}: only the plain interpreter, which adds no effects, can be used there"
        )
        return chosen._replace(checked=bounds, checks_note=_unchecked(checks - bounds, chosen.reason))
    forced = setting.value
    chosen = _by_facts(setting, facts)
    checking = None
    # Races are found inside the plain interpretation (DMAs in flight followed as values, at its own
    # speed) for kernels on one core; by TPU interpret mode's detector where the kernel runs there
    # anyway (several cores or devices, or what plain gets wrong) or where the user forced it; by the
    # Mosaic-GPU interpreter's for Mosaic-GPU kernels. Bounds are checked wherever the kernel runs:
    # the plain interpreter by the guard's index checks, the other two by their own check.
    tpu_wrong = gets_wrong("tpu", facts) if forced is Interpreter.AUTO else None
    on_tpu = forced is Interpreter.TPU or (forced is Interpreter.AUTO and chosen.names[0] == "tpu")
    if "races" in checks and on_tpu and facts.family in (None, "mosaic_tpu"):
        checking = "tpu" if tpu_wrong is None else None
    elif "races" in checks and forced in (Interpreter.AUTO, Interpreter.GPU) and facts.family == "mosaic_gpu":
        checking = "gpu"
    if checking is not None:
        listed = ", ".join(sorted(checks))
        why = f"{describe_interpreter(checking)}, which checks {listed} (from {checks_from})"
        if forced is Interpreter.AUTO and checking == "tpu":
            why = f"{chosen.reason}; {why}"
        return Candidates(
            (checking,),
            why,
            detect_races=True,
            eager_dmas=checking == "tpu" and facts.cross_device is not None,
            checked=checks,
        )
    if chosen.names[0] != "plain" or forced not in (Interpreter.AUTO, Interpreter.PLAIN):
        chosen = chosen._replace(checked=bounds)
    else:
        # The plain interpreter makes both checks itself; where it may hand over to TPU interpret
        # mode (a verified first choice), that one detects races too.
        chosen = chosen._replace(checked=checks, detect_races="races" in checks and "tpu" in chosen.names)
    if "races" in checks and "races" not in chosen.checked:
        if forced is not Interpreter.AUTO:
            why = f"interpreter {forced.value!r} is forced by {setting.source}"
        elif tpu_wrong is not None:
            why = f"not in TPU interpret mode, which detects races: {tpu_wrong}"
        else:
            why = f"{describe_interpreter(chosen.names[0])} cannot detect races"
        chosen = chosen._replace(checks_note=_unchecked(checks - bounds, why))
    if facts.draws_random_bits and chosen.names[0] == "plain":
        chosen = chosen._replace(note=f"{facts.draws_random_bits}: {PLAIN_RANDOM_BITS}")
    return chosen


PLAIN_RANDOM_BITS = (
    "its random bits are pallas_guard's on a CPU (the same seeds give the same bits, each draw new ones), "
    "not the TPU's generator's"
)


def _unchecked(checks: frozenset[str], why: str) -> str | None:
    return f"runs unchecked: {', '.join(sorted(checks))} could not be checked: {why}" if checks else None


def _by_facts(setting: Setting[Interpreter], facts: KernelFacts) -> Candidates:
    """The candidates the facts call for, less those the table says get this kernel wrong (a forced
    interpreter is the user's to answer for)."""
    chosen = _by_family(setting, facts)
    if setting.value is not Interpreter.AUTO:
        return chosen
    wrong = {name: gets_wrong(name, facts) for name in chosen.names}
    kept = tuple(name for name in chosen.names if wrong[name] is None)
    if kept == chosen.names or not kept:
        return chosen
    verify = chosen.verify and len(kept) > 1
    # Reasons read "why: which interpreters"; the interpreters part is rewritten.
    order = ", then ".join(describe_interpreter(name) for name in kept) + (", verified" if verify else "")
    dropped = "; ".join(f"not {describe_interpreter(name)}: {why}" for name, why in wrong.items() if why)
    return chosen._replace(names=kept, verify=verify, reason=f"{chosen.reason.rsplit(': ', 1)[0]}: {order}; {dropped}")


def _by_family(setting: Setting[Interpreter], facts: KernelFacts) -> Candidates:  # noqa: PLR0911
    forced = setting.value
    if forced is not Interpreter.AUTO:
        return Candidates(
            (forced.value,),
            f"interpreter {forced.value!r} forced by {setting.source}",
            eager_dmas=bool(facts.cross_device),
        )
    if facts.cross_device:
        return Candidates(
            ("tpu",), f"needs cross-device TPU semantics ({facts.cross_device}): TPU interpret mode", eager_dmas=True
        )
    wrong = plain_gets_wrong(facts)
    if wrong is not None and facts.family in (None, "mosaic_tpu"):
        return Candidates(("tpu",), f"{wrong}: TPU interpret mode, correct before fast")
    # pl.core_map runs its body when applied: there is no kernel callable to verify, and from jax
    # 0.11.2 (deprecated, served by a module __getattr__) only the lowering net, hence plain, sees it.
    if facts.core_mesh and facts.entry_point != "pl.core_map":
        # The plain interpreter binds no core axis (emit_pipeline's) and cannot discharge bounded-slice
        # DMAs (qwix, tokamax); TPU interpret mode refuses what a TPU would (a direct read of an HBM ref),
        # which the plain one runs.
        return Candidates(
            ("tpu", "plain"),
            f"mapped over a TPU core mesh ({facts.core_mesh}): TPU interpret mode first, verified",
            verify=True,
        )
    if facts.family == "mosaic_gpu":
        if facts.entry_point == "plgpu.kernel":
            return Candidates(("gpu",), "built with plgpu.kernel: only the Mosaic-GPU interpreter runs it")
        # The Mosaic-GPU interpreter runs plgpu primitives but only trivial block windows; the
        # plain one runs any grid of jnp code; TPU interpret mode (without the GPU compiler_params)
        # also runs program_id inside control flow.
        return Candidates(
            ("gpu", "plain", "tpu"),
            f"a Mosaic-GPU kernel ({facts.family_evidence}): the Mosaic-GPU interpreter first, verified",
            verify=True,
        )
    if facts.family == "mosaic_tpu" and facts.plain_risk:
        return Candidates(
            ("plain", "tpu"),
            f"a Mosaic-TPU kernel ({facts.family_evidence}; {facts.plain_risk}): the plain interpreter first "
            "(fastest), verified",
            verify=True,
        )
    if facts.family == "mosaic_tpu":
        return PLAIN_ONLY._replace(
            reason=f"a Mosaic-TPU kernel of block specs and vector code ({facts.family_evidence}): the plain "
            "interpreter runs it, fastest"
        )
    if facts.program_id_in_control_flow:
        # The plain interpreter substitutes program_id only at the body's top level.
        return Candidates(
            ("plain", "tpu"),
            f"program_id inside control flow ({facts.program_id_in_control_flow}): the plain interpreter "
            "first, verified",
            verify=True,
        )
    return PLAIN_ONLY


def available(name: str) -> bool:
    """Whether this jax has interpreter ``name`` (a missing one is reported once)."""
    if (
        name == "plain"
        or (jax_pallas.tpu_params_class() if name == "tpu" else jax_pallas.gpu_params_class()) is not None
    ):
        return True
    jax_lookup.note_missing(
        f"{name.upper()} interpret params class", f"the {name} interpreter is unavailable; using the plain one"
    )
    return False


# --- failures no interpreter can get past -----------------------------------------------------------

_INTERPRETER_NAMES = {
    "plain": "the plain interpreter (interpret=True)",
    "tpu": "TPU interpret mode",
    "gpu": "the Mosaic-GPU interpreter",
}
_FAMILY_NAMES = {"mosaic_tpu": "Mosaic-TPU", "mosaic_gpu": "Mosaic-GPU", "triton": "Triton"}


def describe_interpreter(name: str) -> str:
    return _INTERPRETER_NAMES.get(name, name)


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raised_in(error: BaseException, fragment: str) -> bool:
    traceback = error.__traceback__
    while traceback is not None:
        if fragment in traceback.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        traceback = traceback.tb_next
    return False


# Where JAX's interpreters fail on what they cannot run (measured on third-party kernels and JAX's
# own hardware tests): their own modules, and the discharge rules the plain one lowers through.
_INTERPRETER_MODULES = (
    "pallas/mosaic/interpret",
    "pallas/mosaic_gpu/interpret",
    "pallas/hlo_interpreter",
    "state/discharge",
)


def is_interpreter_gap(error: BaseException) -> bool:
    """Whether ``error`` is an interpreter's limit (a rule it lacks, an assertion or lookup inside
    it) rather than something the kernel's own code got wrong."""
    if isinstance(error, NotImplementedError):
        return True
    return any(_raised_in(error, fragment) for fragment in _INTERPRETER_MODULES)


def _failing_line(error: BaseException) -> str:
    """The source line that raised ``error`` (a C++ Device raises AttributeError with no message)."""
    traceback = error.__traceback__
    if traceback is None:
        return ""
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return linecache.getline(traceback.tb_frame.f_code.co_filename, traceback.tb_lineno).strip()


# Where JAX's host code asks which TPU it runs on: TPU info, a TPU core mesh's core count, tiling.
_TPU_QUESTIONS = (
    "jax/_src/tpu_info.py",
    "_get_tpu_generation",
    "_get_default_num_cores",
    "get_tpu_info",
    "mosaic/core.py:create_tensorcore_mesh",  # jax 0.7: asks the device for num_cores itself
)
_GPU_QUESTIONS = ("Unsupported GPU architecture", "sm80", "sm90", "sm100", "compute capability", "needs an H100")


def which_accelerator_failure(error: BaseException) -> str | None:
    """Why ``error`` happened, when host code asked which TPU/GPU it runs on and got the CPU, with
    the device setting that answers it; else None."""
    from pallas_guard_autoload import DEVICE_ENV

    text = f"{_text(error)} {_failing_line(error)}"
    frames = _frame_names(error)
    tpu = "Unsupported TPU device kind" in text or any(q in name for q in _TPU_QUESTIONS for name in frames)
    if tpu:
        return (
            "the host code asks which TPU it runs on (TPU info, a core mesh's core count, tiling), and the CPU is "
            f"no TPU; set {DEVICE_ENV}=tpu-v5e (or another TPU: pallas_guard.policy(device=...)) to emulate one"
        )
    if (isinstance(error, AttributeError) and "core_count" in text) or any(q in text for q in _GPU_QUESTIONS):
        return (
            "the host code asks which GPU it runs on (its SM count or architecture), and the CPU is no GPU; "
            "host code that reads JAX's abstract device (as JAX's own GPU kernels do) is answered by "
            f"{DEVICE_ENV}=h100 (or a100, b200: pallas_guard.policy(device=...)); code that asks jax.devices() "
            "itself cannot be"
        )
    return None


def _frame_names(error: BaseException) -> list[str]:
    """``file:function`` of each frame ``error`` passed through."""
    names = []
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        names.append(f"{code.co_filename.replace(chr(92), '/')}:{code.co_name}")
        traceback = traceback.tb_next
    return names


def explain_failure(error: BaseException, *, interpreter: str, family: str | None) -> str | None:
    """Why ``interpreter`` cannot run this kernel on the CPU, when ``error`` says so; else None.

    Only failures the guard can attribute to the CPU or to the interpreter are explained; an error
    the kernel's own code caused (a shape mismatch, a bad index) returns None and propagates as is.
    """
    text = f"{_text(error)} {_failing_line(error)}"
    asked = which_accelerator_failure(error)
    if asked is not None:
        return asked
    if isinstance(error, AttributeError | AssertionError) and "cuda_versions" in text:
        return "the kernel's host code asks for the CUDA runtime version, which jaxlib has only with a CUDA plugin"
    if family == "mosaic_gpu" and interpreter != "gpu":
        have = jax_pallas.gpu_params_class() is not None
        return "it is a Mosaic-GPU kernel; only the Mosaic-GPU interpreter implements its primitives" + (
            "" if have else ", and this jax has none (jax >= 0.9.0 has it)"
        )
    if family in ("triton", "mosaic_gpu") and interpreter == "tpu" and _raised_in(error, "pallas/mosaic/"):
        return f"TPU interpret mode runs only Mosaic-TPU and generic kernels, not {_FAMILY_NAMES[family]} ones"
    if family in ("triton", "mosaic_tpu") and interpreter == "gpu" and _raised_in(error, "pallas/mosaic_gpu/"):
        return f"the Mosaic-GPU interpreter runs only Mosaic-GPU kernels, not {_FAMILY_NAMES[family]} ones"
    return None
