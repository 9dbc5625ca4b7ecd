"""Tracing, exporting and running: what JAX is doing in this thread when the guard is called."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pallas_guard._jax.lookup import import_optional, jax_release, note_missing


def tracing() -> bool:
    """True while JAX traces (inside ``jit``, ``vmap``, ...): a kernel called now runs later, for
    whatever platforms the trace is lowered for. False for an eager call, which runs now on the
    default device."""
    core = import_optional("jax._src.core")
    clean = getattr(core, "trace_state_clean", None)
    return True if clean is None else not clean()


_EXPORT_MODULE = "jax._src.export._export"


def export_platforms() -> tuple[str, ...] | None:
    """The platforms of the ``jax.export`` that is tracing right now, or None outside an export.

    ``do_export`` settles its lowering platforms before it traces; the frame keeps them."""
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - a few frames, no source reads
    while frame is not None:
        if frame.f_globals.get("__name__") == _EXPORT_MODULE:
            platforms = frame.f_locals.get("actual_lowering_platforms")
            if isinstance(platforms, tuple) and all(isinstance(p, str) for p in platforms):
                return platforms
            return ()  # an export whose platforms this jax keeps elsewhere: unknown
        frame = frame.f_back
    return None


def mesh_platform() -> tuple[str, str] | None:
    """(platform, device kind) of the devices of the mesh in force (a ``shard_map`` body, a
    ``jax.set_mesh`` scope, a program lowered for a TPU topology's devices); None where no mesh
    with axes is in force, or it does not say."""
    try:
        import jax

        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # a jax without abstract meshes
        return None
    if mesh is None or getattr(mesh, "empty", True):
        return None
    device = getattr(mesh, "abstract_device", None)
    kind = str(getattr(device, "device_kind", "") or "")
    # Before jax 0.10 an abstract device has no platform: its kind says ("cpu", "TPU v5 lite").
    guessed = next((word for word in ("cpu", "tpu") if kind.lower().startswith(word)), None)
    platform = getattr(device, "platform", None) or guessed
    return (str(platform), kind) if platform else None


def running_in(module_names: frozenset[str]) -> bool:
    """True while a function of one of ``module_names`` is on this thread's stack."""
    frame: types.FrameType | None = sys._getframe(2)  # noqa: SLF001 - inspect.stack() reads source files
    while frame is not None:
        if frame.f_globals.get("__name__") in module_names:
            return True
        frame = frame.f_back
    return False


# Where a kernel is traced whose enclosing lowering has no place for an interpreter's ordered
# effects (their tokens): another primitive's lowering rule (a PRNG implementation), and the body of
# a custom_partitioning, lowered by mlir.lower_fun without tokens (KeyError: OrderedIOEffect).
_EFFECTS_REFUSED = (
    ("jax._src.interpreters.mlir", "traced during lowering"),
    ("jax._src.custom_partitioning", "traced inside a custom_partitioning, whose lowering carries no effects"),
)


def effects_refused() -> str | None:
    """Why an interpreter that adds effects at trace time cannot be used where the kernel is being
    traced now, or None."""
    for module_name, why in _EFFECTS_REFUSED:
        if running_in(frozenset({module_name})):
            return why
    return None


def batching_rule_of_our_own() -> Callable[[Callable[..., Any]], Any] | None:
    """``jax.custom_batching.custom_vmap`` where a call of it whose result is unused stays in a
    jitted computation (from jax 0.8: 0.7 drops it); None elsewhere."""
    if jax_release() < (0, 8):
        return None
    custom_batching = import_optional("jax.custom_batching")
    return getattr(custom_batching, "custom_vmap", None)


_JIT_CALL = ("jax._src.pjit", "cache_miss")
"""Where ``jax.jit(f)(x)`` traces ``f`` when its cache misses (jax 0.7-0.12): the call then lowers,
compiles and runs the program before it returns."""
_BOUNDARIES = frozenset({"jax._src.traceback_util", "jax._src.profiler"})


def jit_call_frame() -> types.FrameType | None:
    """The frame of the jit call (``jax.jit(f)(x)``) tracing what is traced now, which runs the
    program before it returns: where the outermost JAX function on this thread's stack is jit's
    call; None for a trace alone (``.lower()``, ``.trace()``, ``eval_shape``, ``make_jaxpr``, an
    export) or a transformation of a jitted function (``vmap``, ``grad``)."""
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - inspect.stack() reads source files
    outermost: types.FrameType | None = None
    while frame is not None:
        module = frame.f_globals.get("__name__")
        if isinstance(module, str) and module.startswith("jax.") and module not in _BOUNDARIES:
            outermost = frame
        frame = frame.f_back
    if outermost is None or (outermost.f_globals.get("__name__"), outermost.f_code.co_name) != _JIT_CALL:
        return None
    return outermost


def on_the_stack(frames: Sequence[types.FrameType]) -> list[bool]:
    """For each of ``frames``, whether it is running on this thread's stack now."""
    running = set()
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - inspect.stack() reads source files
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    return [id(f) in running for f in frames]


def forget_programs() -> None:
    """JAX's traces, lowerings and executables, dropped (``jax.clear_caches()``): what a check refused
    after a jit call traced and compiled its program must be traced again to be judged again."""
    import jax

    clear: Callable[[], None] = jax.clear_caches
    clear()


_PREPARING = frozenset({"jax._src.interpreters.partial_eval", "jax._src.interpreters.mlir", "jax._src.compiler"})


def running_a_program() -> bool:
    """Whether a computation run now is a program's own run, not one made while a program is traced,
    lowered or compiled (a check evaluating index maps, the guard's own measurements)."""
    return not running_in(_PREPARING)


def current_trace() -> Any:
    """The trace JAX binds primitives in now (None where this jax does not say)."""
    context = getattr(import_optional("jax._src.core"), "trace_ctx", None)
    return getattr(context, "trace", None)


def executable_class() -> type | None:
    """JAX's call of a compiled computation in Python (``pxla.ExecuteReplicated``): every
    computation with host callbacks runs through its ``__call__`` (the C++ fast path skips them)."""
    cls = getattr(import_optional("jax._src.interpreters.pxla"), "ExecuteReplicated", None)
    if not isinstance(cls, type):
        note_missing("pxla.ExecuteReplicated", "a run-time finding under jit arrives inside JAX's runtime error")
        return None
    return cls


@contextlib.contextmanager
def retrace_logs_muted() -> Iterator[None]:
    """While the guard traces a kernel again for a check (lowering or compiling it for its target),
    what JAX logs from its own modules at the root logger in this thread is dropped: the kernel's
    first trace logged it already ("AsyncCopyDescriptor was not used", logged as the descriptor is
    collected), and a test that counts the lines of its log sees each once."""
    import logging

    jax_file = getattr(sys.modules.get("jax"), "__file__", None)
    if not jax_file:  # no jax to log: nothing to drop
        yield
        return
    jax_dir = os.path.dirname(jax_file) + os.sep
    thread = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        return record.thread != thread or not record.pathname.startswith(jax_dir)

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


FAST_DISPATCH_DATA = "_get_fastpath_data"
"""What ``jax.jit`` asks, after a computation's first call through Python, for the data of its C++
dispatch (None: every call through Python, as a computation with effects is)."""


def fast_dispatch_module() -> types.ModuleType | None:
    module = import_optional("jax._src.pjit")
    if module is None or not callable(vars(module).get(FAST_DISPATCH_DATA)):
        note_missing(
            f"pjit.{FAST_DISPATCH_DATA}",
            "a run-time finding of a jitted call after its first may arrive inside JAX's runtime error",
        )
        return None
    return module


def manual_mesh() -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The axis names and sizes of the mesh a ``shard_map`` being traced here maps over (its
    manual axes); None outside one."""
    try:
        import jax

        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # a jax without abstract meshes: no shard_map is known here
        return None
    if not getattr(mesh, "manual_axes", ()):
        return None
    return tuple(mesh.axis_names), tuple(mesh.axis_sizes)


def per_shard(function: Callable[..., Any], mesh: Any) -> Callable[..., Any]:
    """``function`` inside ``shard_map`` over ``mesh``, each device given the whole operands (the
    per-shard ones a kernel sees) and returning its own outputs unchecked for replication."""
    import jax

    jax_any: Any = jax
    spec = jax_any.sharding.PartitionSpec()
    shard_map = getattr(jax_any, "shard_map", None)
    if shard_map is not None:
        mapped: Callable[..., Any] = shard_map(function, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return mapped
    experimental: Any = importlib.import_module("jax.experimental.shard_map")
    mapped = experimental.shard_map(function, mesh=mesh, in_specs=spec, out_specs=spec, check_rep=False)
    return mapped


def in_mesh(mesh: Any) -> contextlib.AbstractContextManager[Any]:
    """``mesh`` as the context's abstract mesh: a program for another mesh (a TPU topology's)
    lowered while a ``shard_map`` over this host's devices is being traced."""
    import jax

    # Inside a trace only the abstract mesh may change (jax.set_mesh is refused under jit).
    scope = getattr(jax.sharding, "use_abstract_mesh", None)
    abstract = getattr(mesh, "abstract_mesh", None)
    if scope is None or abstract is None:
        return contextlib.nullcontext()
    entered: contextlib.AbstractContextManager[Any] = scope(abstract)
    return entered


@contextlib.contextmanager
def outside_meshes() -> Iterator[None]:
    """Neither a concrete mesh (``jax.set_mesh``) nor an abstract one in force: a program for a TPU
    topology's devices is lowered apart from the mesh of this host's devices the user set."""
    from pallas_guard._jax.lookup import first_attribute

    mesh = import_optional("jax._src.mesh")
    states: list[tuple[Any, Any]] = [
        (first_attribute([("jax._src.mesh", state), ("jax._src.config", state)]), getattr(mesh, empty, None))
        for state, empty in (
            ("device_context", "empty_concrete_mesh"),
            ("abstract_mesh_context_manager", "empty_abstract_mesh"),
        )
    ]
    if any(not hasattr(state, "swap_local") or empty is None for state, empty in states):
        yield  # a jax without these: a kernel under set_mesh is then left unchecked, and says so
        return
    previous = [state.swap_local(empty) for state, empty in states]
    try:
        yield
    finally:
        for (state, _), value in zip(states, previous, strict=True):
            state.set_local(value)


def as_vmap_calls_it(function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``function`` and ``args`` as the program calls them where ``args`` hold ``jax.vmap``'s tracers
    (a kernel called under ``vmap``): ``function`` wrapped in a ``vmap`` per level, the operands with
    their batch axes; else both unchanged. A compiler then compiles the kernel the batching rule
    makes (its grid has the batch axes), not the one the call sees."""
    import jax

    batching = import_optional("jax._src.interpreters.batching")
    tracer, unmapped = getattr(batching, "BatchTracer", None), getattr(batching, "not_mapped", None)
    if tracer is None:
        return function, args
    leaves, tree = jax.tree_util.tree_flatten(args)
    levels: list[list[int | None]] = []
    while True:
        batched = [leaf for leaf in leaves if isinstance(leaf, tracer)]
        if not batched:
            break
        inner = {id(leaf.val) for leaf in batched}  # the outer levels' tracers, wrapped by an inner one
        traces = {id(leaf._trace) for leaf in batched if id(leaf) not in inner}  # noqa: SLF001
        dims: list[int | None] = []
        peeled = []
        for leaf in leaves:
            if isinstance(leaf, tracer) and id(leaf._trace) in traces:  # noqa: SLF001
                dim = leaf.batch_dim
                if dim is not unmapped and not isinstance(dim, int):  # a ragged axis: not rebuilt
                    return function, args
                dims.append(None if dim is unmapped else dim)
                peeled.append(leaf.val)
            else:
                dims.append(None)
                peeled.append(leaf)
        if len(traces) != 1 or all(dim is None for dim in dims):
            return function, args
        levels.append(dims)
        leaves = peeled
    for dims in levels:  # innermost first: each vmap wraps the one inside it
        axes = jax.tree_util.tree_unflatten(tree, dims)
        function = jax.vmap(function, in_axes=tuple(axes))
    return function, tuple(jax.tree_util.tree_unflatten(tree, leaves))
