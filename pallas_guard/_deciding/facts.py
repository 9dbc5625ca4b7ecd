"""What the guard knows of a kernel before its body is traced: its facts.

The facts are read without tracing the body: the backend from the defining module of
``compiler_params``/mesh/grid spec/scratch types, and the names the body's code uses (cross-device
semantics, program ids in control flow, random bits, refs captured from outside). The interpreter
choice (``interpreters``) reads them.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state


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
