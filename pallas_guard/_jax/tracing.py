"""The one place that locates JAX internals, by feature detection with fallbacks.

Each lookup tries the names JAX has used across the supported versions (see README,
"Compatibility"). A lookup that finds nothing is recorded in :data:`missing`, so the guard can
warn once, keep every layer that still works, and diagnostics can say what was missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import itertools
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

from pallas_guard._vocabulary.errors import PallasGuardWarning

missing: dict[str, str] = {}
"""Internal name -> what the guard cannot do without it. Filled as lookups fail."""

_missing_lock = threading.Lock()
_warned_missing: set[str] = set()


def import_optional(name: str) -> types.ModuleType | None:
    """Import ``name`` or return None; ImportError covers a missing optional dependency (absl).

    A module found absent stays absent for the process: its import is tried (as a probe, under
    :func:`probing`) once, not at every kernel call."""
    module = sys.modules.get(name)  # the common case, on every kernel call: no import machinery
    if module is not None or name in _absent_modules:
        return module
    try:
        with probing():
            return importlib.import_module(name)
    except ImportError:
        _absent_modules.add(name)
        return None


_absent_modules: set[str] = set()
_ABSENT = object()


def first_attribute(candidates: Iterable[tuple[str, str]]) -> Any | None:
    """The first ``module.attribute`` of ``candidates`` that the module itself defines, else None.

    Read from the module's namespace, never through ``getattr``: a name JAX serves from a module
    ``__getattr__`` is one it deprecated (``jax.pallas.pallas_call_p`` from 0.12.1), and asking for
    it warns in the user's process (an error under ``-W error``); the next candidate is the route
    JAX keeps."""
    for module_name, attribute in candidates:
        module = import_optional(module_name)
        if module is not None:
            found = vars(module).get(attribute, _ABSENT)
            if found is not _ABSENT:
                return found
    return None


_probe = threading.local()
_IGNORE_ALL = [("ignore", None, Warning, None, 0)]


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Inside: what JAX warns while the guard looks it over (a deprecated name, an import) is
    dropped, whatever the user's warning filters say (``-W error``, ``filterwarnings = error``), so
    a probe never warns, prints or raises in the user's process; the guard's own warnings
    (:func:`note_missing`) are warned on the way out, under the user's filters.

    The filter list is swapped, not changed through ``warnings`` (``catch_warnings``, ``simplefilter``):
    those bump Python's filter version, which makes every warning already shown once per location
    show again. The swap is process-wide for its instant (as ``catch_warnings`` is before Python
    3.14's context-aware warnings): a warning another thread raises then is dropped too. Probes are
    few and short (the arming, a module's first import), never on a kernel's hot path."""
    if getattr(_probe, "depth", 0):
        _probe.depth += 1
        try:
            yield
        finally:
            _probe.depth -= 1
        return
    saved = warnings.filters
    warnings.filters = list(_IGNORE_ALL)
    _probe.depth, _probe.pending = 1, []
    try:
        yield
    finally:
        warnings.filters = saved
        _probe.depth = 0
    pending, _probe.pending = _probe.pending, []
    for text in pending:
        warnings.warn(text, PallasGuardWarning, stacklevel=3)


def jax_version(package: str = "jax") -> str:
    """The running jax's version (or jaxlib's: ``package="jaxlib"``), for messages only."""
    return str(getattr(sys.modules.get(package), "__version__", "unknown"))


def _warn_once(key: str, text: str) -> None:
    with _missing_lock:
        if key in _warned_missing:
            return
        _warned_missing.add(key)
    if getattr(_probe, "depth", 0):  # inside a probe: warned when it ends, under the user's filters
        _probe.pending.append(text)
        return
    warnings.warn(text, PallasGuardWarning, stacklevel=3)


def note_missing(name: str, consequence: str) -> None:
    """Record a missing internal and warn once per name (never an error: the guard degrades)."""
    with _missing_lock:
        missing[name] = consequence
    _warn_once(name, f"pallas_guard: JAX internal {name!r} not found in jax {jax_version()}; {consequence}.")


TESTED_BELOW = (0, 13)
"""The first jax release past the range CI proves (pyproject's upper bound ``jax<0.13``)."""
SUPPORTED = "jax>=0.7.2,<0.13"
"""The range CI proves, as pyproject.toml declares it (a test keeps the two in step)."""


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def jax_release() -> tuple[int, ...]:
    """The running jax's release as numbers, ``(0, 10, 2)``; empty when unknown."""
    return _release_cached(jax_version())


_release_cached = functools.lru_cache(maxsize=4)(_release)


def tested_range_notice() -> str | None:
    """The notice for a jax past the tested range, else None; shown by the pytest header and
    ``doctor``, never warned: it concerns the installation, not a kernel, and a warning while
    pytest configures would stop a ``filterwarnings = error`` session. What the guard does there is
    decided by feature detection, and a missing internal is reported by :func:`note_missing`."""
    version = jax_version()
    release = _release(version)
    if not (release and release >= TESTED_BELOW):
        return None
    tested = ".".join(map(str, TESTED_BELOW))
    return (
        f"jax {version} is newer than the range pallas_guard was tested with (jax < {tested}); it keeps "
        "every layer whose JAX internals it finds, reports any it does not, and refuses with a diagnostic "
        "where it cannot run a kernel interpreted"
    )


# --- primitives ---------------------------------------------------------------------------------


def pallas_call_primitive() -> Any | None:
    return first_attribute(
        # Where JAX defines it first: jax 0.12.1 deprecated the public name (a warning on access).
        [("jax._src.pallas.pallas_call", "pallas_call_p"), ("jax.experimental.pallas", "pallas_call_p")]
    )


def mpmd_map_primitive() -> Any | None:
    """``mpmd_map_p`` (jax >= 0.9.1): ``pl.kernel``/``core_map``/``plgpu.kernel`` lower through it."""
    return first_attribute([("jax._src.pallas.mpmd", "mpmd_map_p")])


def has_mpmd_module() -> bool:
    """True where ``pl.kernel`` & co. lower through ``jax._src.pallas.mpmd`` (jax >= 0.9.1)."""
    return import_optional("jax._src.pallas.mpmd") is not None


# --- interpreters: their params classes ---------------------------------------------------------


def tpu_params_class() -> type | None:
    """TPU interpret mode's ``InterpretParams`` (the concrete class, never a shared base)."""
    return first_attribute(
        [
            ("jax.experimental.pallas.tpu", "InterpretParams"),
            ("jax._src.pallas.mosaic.interpret.params", "InterpretParams"),  # 0.10.0+
            ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "InterpretParams"),  # 0.8.0 - 0.9.2
            ("jax._src.pallas.mosaic.interpret", "InterpretParams"),  # 0.6.2 - 0.7.2
        ]
    )


def gpu_params_class() -> type | None:
    """The Mosaic-GPU interpreter's params class: ``InterpretGPUParams`` (public in 0.11.1+), or the
    ``plgpu.InterpretParams`` name proposed upstream, or the 0.9.x internal one."""
    return first_attribute(
        [
            ("jax._src.pallas.mosaic_gpu.interpret.params", "InterpretGPUParams"),  # 0.10.0+
            ("jax.experimental.pallas.mosaic_gpu", "InterpretGPUParams"),  # public 0.11.1+
            ("jax.experimental.pallas.mosaic_gpu", "InterpretParams"),  # proposed public name
            ("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call", "InterpretParams"),  # 0.9.x
        ]
    )


def interpreter_of(value: Any) -> str | None:
    """Which interpreter an ``interpret=`` value selects: ``plain``, ``tpu``, ``gpu``; None if falsy."""
    if not value:
        return None
    if value is True:
        return "plain"
    module = type(value).__module__
    if "mosaic_gpu" in module:
        return "gpu"
    if "mosaic" in module:
        return "tpu"
    return type(value).__name__


# --- tracing and exporting ------------------------------------------------------------------------


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


# --- MLIR lowering registries -------------------------------------------------------------------


class LoweringRegistry:
    """``register_lowering`` and the registries it writes, as found in this jax."""

    def __init__(self, mlir: types.ModuleType) -> None:
        self.register_lowering: Callable[..., Any] = mlir.register_lowering
        self.common: MutableMapping[Any, Any] = mlir._lowerings  # noqa: SLF001
        self.cpu: MutableMapping[Any, Any] = mlir._platform_specific_lowerings["cpu"]  # noqa: SLF001

    def common_rule(self, primitive: Any) -> Callable[..., Any] | None:
        return unwrap_rule(self.common.get(primitive))


def lowering_registry() -> LoweringRegistry | None:
    for name in ("jax.interpreters.mlir", "jax._src.interpreters.mlir"):
        mlir = import_optional(name)
        if mlir is None:
            continue
        try:
            return LoweringRegistry(mlir)
        except (AttributeError, KeyError, TypeError):
            continue
    return None


def unwrap_rule(entry: Any) -> Callable[..., Any] | None:
    """The rule inside a registry entry: a ``LoweringRuleEntry`` from jax 0.7, a bare function before."""
    if entry is None:
        return None
    rule = getattr(entry, "rule", entry)
    return rule if callable(rule) else None


# --- configuration and backends, all read without initialising a backend ------------------------


_config_holders: dict[str, Any] = {}  # read on every kernel call: found once, where found


def jax_config_value(name: str) -> Any:
    """A ``jax.config`` value as seen in this thread/context (scopes included); None if absent."""
    holder = _config_holders.get(name)
    if holder is None:
        config = import_optional("jax._src.config")
        holder = getattr(config, name.removeprefix("jax_"), None) if config is not None else None
        if holder is not None and hasattr(holder, "value"):
            _config_holders[name] = holder
    if holder is not None and hasattr(holder, "value"):
        return holder.value
    jax = sys.modules.get("jax")
    return getattr(getattr(jax, "config", None), name, None)


def interpret_mode_config() -> Any | None:
    """JAX's trace-time interpret switch (``pltpu.force_tpu_interpret_mode``), jax >= 0.7.0."""
    config = import_optional("jax._src.config")
    return getattr(config, "pallas_tpu_interpret_mode_context_manager", None)


def forced_interpret_value() -> Any:
    holder = interpret_mode_config()
    return None if holder is None else holder.value


def backends_initialized() -> bool:
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is None:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", None))


def default_backend() -> str | None:
    """``jax.default_backend()``, but only when calling it cannot initialise a backend."""
    if not backends_initialized():
        return None
    jax = sys.modules.get("jax")
    return None if jax is None else str(jax.default_backend())


# --- source locations ---------------------------------------------------------------------------

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The package's own directory: its frames are the guard's, in every layer."""


_frames_excluded = False


def exclude_guard_frames_from_jax_tracebacks() -> None:
    """Make JAX treat pallas_guard's frames as internal, in its user-frame search and tracebacks."""
    global _frames_excluded  # noqa: PLW0603
    # Once per process: each call appends to JAX's list again and clears its is_user_filename
    # cache, which every traced operation consults; install()/uninstall() cycles would pay that.
    if _frames_excluded:
        return
    source_info = import_optional("jax._src.source_info_util")
    register = getattr(source_info, "register_exclusion", None)
    if register is not None:
        register(PACKAGE_DIR)
        _frames_excluded = True


def current_traceback() -> Any | None:
    """The traceback JAX has set as the current source-info context (the equation being lowered or
    discharged), or None."""
    source_info = sys.modules.get("jax._src.source_info_util")
    current = getattr(source_info, "current", None)
    return getattr(current(), "traceback", None) if current is not None else None


def lowering_frames(ctx: Any) -> list[tuple[str, int]]:
    """``(file, line)`` of the non-jax frames of the equation being lowered, innermost first.

    The rule context carries its traceback on the inline path; on the cached path JAX leaves it
    None but sets the equation's traceback as the current source-info context.
    """
    source_info = import_optional("jax._src.source_info_util")
    traceback = getattr(ctx, "traceback", None) or current_traceback()
    if source_info is None or traceback is None:
        return []
    frames = getattr(source_info, "user_frames", None)
    if frames is not None:
        return [(frame.file_name, frame.start_line) for frame in frames(traceback)]
    find = getattr(source_info, "user_frame", None)
    frame = find(traceback) if find is not None else None
    return [] if frame is None else [(frame.file_name, frame.start_line)]


def abstract_mesh_config() -> Any | None:
    """JAX's config state of the current abstract mesh (``get_global``/``set_global``/``value``),
    where jax is imported: ``jax._src.mesh`` from 0.12, ``jax._src.config`` before."""
    if "jax" not in sys.modules:
        return None
    for module_name in ("jax._src.mesh", "jax._src.config"):
        holder = getattr(import_optional(module_name), "abstract_mesh_context_manager", None)
        if holder is not None and hasattr(holder, "set_global"):
            return holder
    return None


def is_state_ref(value: object) -> bool:
    """Whether ``value`` is a JAX state ref (a ``Ref``, or a tracer of one inside ``run_state``)."""
    aval = getattr(value, "aval", None)
    return type(aval).__name__ == "AbstractRef" and type(aval).__module__.startswith("jax._src.state")


def equation_family(params: Mapping[str, Any]) -> str | None:
    """The backend a kernel equation was written for, from its ``compiler_params`` (an object from
    jax 0.9.1, a Mapping keyed by backend before)."""
    compiler_params = params.get("compiler_params")
    if isinstance(compiler_params, Mapping):
        return next((BACKEND_NAMES.get(str(key)) for key in compiler_params), None)
    return backend_family(compiler_params) if compiler_params is not None else None


def lowering_platforms(ctx: Any) -> tuple[str, ...]:
    """The platforms a lowering rule context lowers for (the CPU branch of an export: ``("cpu",)``)."""
    platforms = getattr(getattr(ctx, "module_context", None), "platforms", None)
    return tuple(platforms) if platforms else ("cpu",)


def equation_grid(params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The grid of a ``pallas_call_p`` equation (its ``grid_mapping``); None for ``mpmd_map_p``."""
    grid_mapping = params.get("grid_mapping")
    grid = getattr(grid_mapping, "grid", None)
    return tuple(grid) if grid is not None else None


# --- kernel facts: which backend a kernel was written for, and interpreter state ----------------

# The modules that define each backend's CompilerParams, meshes, grid specs and scratch types; they
# have not moved in any supported version, while the class names were renamed (0.6.x).
BACKEND_MODULES = {
    "jax._src.pallas.mosaic.core": "mosaic_tpu",
    "jax._src.pallas.mosaic_gpu.core": "mosaic_gpu",
    "jax._src.pallas.triton.core": "triton",
}
# Keys of a compiler_params Mapping (jax <= 0.9.0.1) and values of the old ``backend=`` argument.
BACKEND_NAMES = {"mosaic": "mosaic_tpu", "mosaic_tpu": "mosaic_tpu", "mosaic_gpu": "mosaic_gpu", "triton": "triton"}


def backend_family(obj: object) -> str | None:
    """``"mosaic_tpu"``, ``"mosaic_gpu"`` or ``"triton"`` from the module that defines ``obj``'s type."""
    if type(obj) is str:  # not a str-valued Enum such as SemaphoreType
        return BACKEND_NAMES.get(obj)
    module = type(obj).__module__
    found = BACKEND_MODULES.get(module)
    if found is None:  # a backend's other modules: SparseCore meshes (mosaic.sc_core), ...
        found = next((family for package, family in _BACKEND_PACKAGES if module.startswith(package)), None)
    return found


# Longest first: mosaic_gpu's package name starts with mosaic's.
_BACKEND_PACKAGES = (
    ("jax._src.pallas.mosaic_gpu.", "mosaic_gpu"),
    ("jax._src.pallas.mosaic.", "mosaic_tpu"),
    ("jax._src.pallas.triton.", "triton"),
)


# Where each interpreter keeps its race detector's state: (module, attribute), newest first.
_RACE_STATES = {
    "tpu": (
        ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "races"),  # 0.8.0+
        ("jax._src.pallas.mosaic.interpret", "races"),  # 0.6.2 - 0.7.x (a module, not a package)
    ),
    "gpu": (("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks", "_races"),),
}


# Each interpreter's reset of its global state (simulated memory, race detector), newest first.
_RESETS = {
    "tpu": (
        ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "reset_tpu_interpret_mode_state"),  # 0.8.0+
        ("jax._src.pallas.mosaic.interpret", "reset_tpu_interpret_mode_state"),  # 0.6.2 - 0.7.x
    ),
    "gpu": (("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks", "reset_gpu_interpret_mode_state"),),  # 0.9.0+
}


def reset_interpreter(interpreter: str) -> None:
    """Clear ``interpreter``'s global state, as its own clean-up does when a kernel returns.

    Needed where an error stops a computation before that clean-up runs: the next kernel would
    otherwise find the old simulated memory (an AssertionError inside the interpreter) and the
    old race detector (a race reported in a kernel that has none)."""
    locations = _RESETS.get(interpreter, ())
    reset = first_attribute(locations)
    if reset is None:
        note_missing(f"{interpreter.upper()} interpret mode state reset", "a kernel after a race may fail")
        return
    reset()


def races_found(interpreter: str = "tpu") -> bool | None:
    """Whether ``interpreter``'s race detector flagged the last kernel; None if unknown."""
    for module_name, attribute in _RACE_STATES.get(interpreter, ()):
        module = import_optional(module_name)
        if module is not None and hasattr(module, attribute):
            return bool(getattr(getattr(module, attribute), "races_found", False))
    note_missing(f"{interpreter.upper()} interpret mode race state", "races cannot be reported as PallasGuardError")
    return None


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


# --- the bounds check on the plain interpreter ----------------------------------------------------

_STATE_DISCHARGE = "jax._src.state.discharge"


class DischargeRegistry(NamedTuple):
    """One of JAX's tables of state discharge rules, and how many positional arguments come before
    a rule's operands: ``ctx`` (jax >= 0.11.2); ``in_avals, out_avals`` before; partial rules
    (before 0.11.2) take ``should_discharge`` first."""

    rules: MutableMapping[Any, Any]
    leading: int


def state_discharge_module() -> types.ModuleType | None:
    return import_optional(_STATE_DISCHARGE)


def forget_discharges() -> None:
    """Empty JAX's cache of state discharges (kept per jaxpr object)."""
    clear = getattr(getattr(state_discharge_module(), "_discharge_state", None), "cache_clear", None)
    if callable(clear):
        clear()


DISCHARGE_EVALUATOR = "_eval_jaxpr_discharge_state"
"""The function that discharges one jaxpr, calling each equation's discharge rule; a rule of a
loop, branch or scope discharges its body through it again (a module function looked up by name)."""


def discharge_registries() -> list[DischargeRegistry]:
    module = state_discharge_module()
    if module is None:
        return []
    found = []
    rules = getattr(module, "_discharge_rules", None)
    if isinstance(rules, MutableMapping):
        found.append(DischargeRegistry(rules, 1 if hasattr(module, "DischargeContext") else 2))
    partial_rules = getattr(module, "_partial_discharge_rules", None)
    if isinstance(partial_rules, MutableMapping):
        found.append(DischargeRegistry(partial_rules, 3))
    return found


class RefAccess(NamedTuple):
    """A primitive that reads or writes refs, as its discharge rule receives it."""

    primitive: Any
    kind: str
    """``read``, ``write`` or ``copy`` (a DMA: its source read, its destination written)."""
    tree_param: str
    """The parameter holding the operands' tree structure."""
    leading: int
    """Operands before the flattened tree (the ref; the ref and the value written)."""
    mask_at: int | None = None
    """Where the mask is in the unflattened operands (masked loads and stores), or None."""


_REF_ACCESSES = (
    # (module, primitive, kind, tree parameter, operands before the tree, mask position)
    ("jax._src.state.primitives", "get_p", "read", "tree", 1, None),
    ("jax._src.state.primitives", "swap_p", "write", "tree", 2, None),
    ("jax._src.state.primitives", "addupdate_p", "write", "tree", 2, None),
    ("jax._src.pallas.primitives", "load_p", "read", "args_tree", 0, 2),
    ("jax._src.pallas.primitives", "swap_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.primitives", "atomic_rmw_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.triton.primitives", "atomic_rmw_p", "write", "args_tree", 0, 3),
    ("jax._src.pallas.mosaic.primitives", "dma_start_p", "copy", "tree", 0, None),
)


def ref_accesses() -> list[RefAccess]:
    """The ref-access primitives of the modules already imported (a kernel using one has imported
    its module before it is lowered)."""
    found: dict[int, RefAccess] = {}
    for module_name, name, kind, tree_param, leading, mask_at in _REF_ACCESSES:
        primitive = getattr(sys.modules.get(module_name), name, None)
        if primitive is not None and id(primitive) not in found:
            found[id(primitive)] = RefAccess(primitive, kind, tree_param, leading, mask_at)
    return list(found.values())


def batching_rule_of_our_own() -> Callable[[Callable[..., Any]], Any] | None:
    """``jax.custom_batching.custom_vmap`` where a call of it whose result is unused stays in a
    jitted computation (from jax 0.8: 0.7 drops it); None elsewhere."""
    if jax_release() < (0, 8):
        return None
    custom_batching = import_optional("jax.custom_batching")
    return getattr(custom_batching, "custom_vmap", None)


def current_trace() -> Any:
    """The trace JAX binds primitives in now (None where this jax does not say)."""
    context = getattr(import_optional("jax._src.core"), "trace_ctx", None)
    return getattr(context, "trace", None)


def nd_indexer_class() -> type[Any] | None:
    cls = first_attribute([("jax._src.state.indexing", "NDIndexer")])
    return cls if isinstance(cls, type) else None


def slice_class() -> type[Any] | None:
    cls = first_attribute([("jax._src.state.indexing", "Slice")])
    return cls if isinstance(cls, type) else None


def executable_class() -> type | None:
    """JAX's call of a compiled computation in Python (``pxla.ExecuteReplicated``): every
    computation with host callbacks runs through its ``__call__`` (the C++ fast path skips them)."""
    cls = getattr(import_optional("jax._src.interpreters.pxla"), "ExecuteReplicated", None)
    if not isinstance(cls, type):
        note_missing("pxla.ExecuteReplicated", "a run-time finding under jit arrives inside JAX's runtime error")
        return None
    return cls


def hlo_interpreter_module() -> types.ModuleType | None:
    return import_optional("jax._src.pallas.hlo_interpreter")


BLOCK_COPY = "_dynamic_slice"
"""The plain interpreter's copy of a block in at each grid step (a module function it calls by name)."""


def host_question_inside(attribute: str) -> tuple[types.ModuleType, str] | None:
    """Where a public host function is served by a deprecation ``__getattr__`` (which hands out the
    function object itself, so no attribute of ours is seen), the JAX function it asks through
    first, as (module, attribute); None where there is none."""
    if attribute == "create_tensorcore_mesh":  # deprecated from jax 0.12; asks for the core count
        module = import_optional("jax._src.pallas.mosaic.core")
        if module is not None and callable(vars(module).get("_get_default_num_cores")):
            return module, "_get_default_num_cores"
    return None


def block_aval(mapping: Any) -> Any | None:
    """The aval of one block of a ``BlockMapping`` (its shape, dtype, memory space), transforms
    applied: ``transformed_block_aval`` up to jax 0.12.0.1, ``block_aval`` from 0.12.1 (which dropped
    block transforms); None where neither exists."""
    return getattr(mapping, "transformed_block_aval", None) or getattr(mapping, "block_aval", None)


def block_mapping_class() -> type[Any] | None:
    cls = first_attribute([("jax._src.pallas.core", "BlockMapping")])
    return cls if isinstance(cls, type) else None


BLOCK_START = "compute_start_indices_interpret"
"""The plain interpreter's computation, at each grid step, of where a block mapping's block starts
(a ``BlockMapping`` method taking the step's program ids, called just before the block copies)."""


def program_ids(grid_mapping: Any) -> list[Any] | None:
    """The program ids of the grid step being run, as values a kernel's discharged jaxpr computes:
    ``program_id`` bound while discharging (JAX's tracing grid context makes that legal) is, when
    the plain interpreter evaluates the jaxpr inside a step, that step's index on each axis. None
    where this jax lacks the pieces or the grid is not plain integers."""
    core = import_optional("jax._src.pallas.core")
    tracing_grid_env = getattr(core, "tracing_grid_env", None)
    program_id = first_attribute([("jax._src.pallas.primitives", "program_id")])
    grid = tuple(getattr(grid_mapping, "grid", None) or ())
    vmapped = tuple(getattr(grid_mapping, "vmapped_dims", None) or ())
    if tracing_grid_env is None or program_id is None or getattr(grid_mapping, "local_grid_env", None) is not None:
        return None
    if not all(isinstance(n, int) for n in grid):
        return None
    try:
        with tracing_grid_env(grid, vmapped):
            return [program_id(axis) for axis in range(len(grid) - len(vmapped))]
    except Exception:  # a jax whose grid context works otherwise: no grid step in the finding
        return None


WRITE_BACK = "_dynamic_update_slice"
"""The plain interpreter's copy of a block back out at each grid step (a module function it calls by
name, once per block operand in the order of the grid mapping's block mappings)."""


GRID_LOOPS = "loops"
"""The module through which the plain interpreter calls its grid loop (``loops.while_loop``)."""


def written_blocks(params: Mapping[str, Any]) -> frozenset[int] | None:
    """The positions, among the block operands of a ``pallas_call`` (the grid mapping's block
    mappings), of those whose ref the kernel writes: what the kernel jaxpr's write and accumulate
    effects name (JAX's own interpreter reads them the same way to keep aliased pairs in step);
    None where this jax's effects cannot be read that way."""
    state = import_optional("jax._src.state.types")
    kinds = tuple(k for k in (getattr(state, "WriteEffect", None), getattr(state, "AccumEffect", None)) if k)
    jaxpr, mapping = params.get("jaxpr"), params.get("grid_mapping")
    invars = list(getattr(jaxpr, "invars", None) or ())
    effects = getattr(jaxpr, "effects", None)
    blocks = len(getattr(mapping, "block_mappings", None) or ())
    first = getattr(mapping, "num_index_operands", None)
    if len(kinds) != 2 or effects is None or not isinstance(first, int) or first + blocks > len(invars):
        return None
    written = set()
    for effect in effects:
        if not isinstance(effect, kinds):
            continue
        target = getattr(effect, "input", getattr(effect, "input_index", None))
        if isinstance(target, int) and not isinstance(target, bool):
            position = target  # an index into the invars (older jax)
        else:
            position = next((i for i, var in enumerate(invars) if var is target), -1)
        if position < 0:
            return None  # a write the guard cannot place: every block is written back
        written.add(position - first)
    return frozenset(p for p in written if 0 <= p < blocks)


def access_site(eqn: Any = None) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the kernel code that made the access being discharged (or
    equation ``eqn``): the innermost frame outside jax's internals and the guard (JAX's own kernels
    count: they live outside ``jax/_src``)."""
    traceback = current_traceback() if eqn is None else getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is None:
        return None
    internal = (f"{os.sep}jax{os.sep}_src{os.sep}", PACKAGE_DIR + os.sep, "<frozen")
    for frame in getattr(traceback, "frames", ()):
        filename = str(getattr(frame, "file_name", ""))
        if filename and not any(part in filename for part in internal):
            line = getattr(frame, "line_num", None) or getattr(frame, "start_line", 0)
            return filename, int(line or 0), str(getattr(frame, "function_name", ""))
    return None


# --- the plain interpreter, as JAX's pallas_call lowering rule calls it ---------------------------


def plain_interpreter(params: Mapping[str, Any]) -> Callable[..., Any] | None:
    """What ``_pallas_call_lowering`` lowers with ``mlir.lower_fun`` for ``interpret=True``: the HLO
    interpreter with the equation's other params (``backend`` among them before jax 0.9.1); None
    where this jax lacks it, or where JAX's rule raises before interpreting (constants)."""
    interpret = getattr(hlo_interpreter_module(), "pallas_call_hlo_interpret", None)
    jaxpr = params.get("jaxpr")
    if interpret is None or getattr(jaxpr, "constvars", True):
        return None
    return functools.partial(interpret, **{k: v for k, v in params.items() if k != "interpret"})


def lowering_tools() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """``(make_jaxpr, jaxpr_as_fun, lower_fun)``: trace a function to a closed jaxpr, replay one,
    and lower a traceable function as a rule (``lower_fun(f, multiple_results=True)(ctx, *nodes)``)."""
    make = first_attribute([("jax", "make_jaxpr")])
    replay = first_attribute([("jax._src.core", "jaxpr_as_fun"), ("jax.core", "jaxpr_as_fun")])
    lower = first_attribute([("jax.interpreters.mlir", "lower_fun"), ("jax._src.interpreters.mlir", "lower_fun")])
    if make is None or replay is None or lower is None:
        return None
    return make, replay, lower


def trace_context() -> Any:
    """JAX's key of the configuration a trace depends on (what ``jit`` keys its traces with); None
    where this jax has none."""
    config = import_optional("jax._src.config")
    function = getattr(config, "trace_context", None)
    if function is None:
        return None
    try:
        return function()
    except Exception:  # a changed internal: no key, so nothing is reused
        return None


def jaxpr_equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (a jaxpr or a closed one), and of the jaxprs in their params,
    recursively (a ``cond``'s branches, a loop's body)."""
    pending = [jaxpr]
    while pending:
        current = pending.pop()
        inner = getattr(current, "jaxpr", None)
        if inner is not None and inner is not current and hasattr(inner, "eqns"):
            current = inner
        for eqn in getattr(current, "eqns", ()):
            yield eqn
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                        pending.append(item)


def private_copy(jaxpr: Any) -> Any:
    """``jaxpr`` rebuilt from fresh objects down to every nested jaxpr (a ``jit`` helper's, a
    ``run_state`` body, loop and branch bodies), sharing equations' variables and values.

    JAX caches what it derives from a jaxpr (its state discharge, above all) by the jaxpr object,
    weakly: a transformation that changes a discharge rule must not read what an earlier lowering
    cached, nor leave its own result where a later lowering would read it. On a private copy both
    hold, and the cache entries die with the copy."""

    def copy(value: Any) -> Any:
        inner = getattr(value, "jaxpr", None)
        if inner is not None and inner is not value and hasattr(inner, "eqns"):  # a ClosedJaxpr (jax < 0.12)
            return value.replace(jaxpr=copy(inner))
        if hasattr(value, "eqns") and callable(getattr(value, "replace", None)):
            eqns = [e.replace(params={k: param(v) for k, v in e.params.items()}) for e in value.eqns]
            return value.replace(eqns=eqns)
        return value

    def param(value: Any) -> Any:
        if isinstance(value, tuple | list) and any(_jaxpr_like(item) for item in value):
            return type(value)(copy(item) if _jaxpr_like(item) else item for item in value)
        return copy(value) if _jaxpr_like(value) else value

    return copy(jaxpr)


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


def private_params(params: dict[str, Any]) -> dict[str, Any]:
    """A ``pallas_call`` equation's params with private copies (``private_copy``) of the kernel's
    jaxpr and of every block's index map: the interpreters discharge index maps too (a map that
    reads scalar-prefetch refs has state), cached by the index map's jaxpr object."""
    private = {**params, "jaxpr": private_copy(params["jaxpr"])}
    grid_mapping = params.get("grid_mapping")
    mappings = getattr(grid_mapping, "block_mappings", None)
    if mappings and dataclasses.is_dataclass(grid_mapping):
        copied = tuple(
            dataclasses.replace(m, index_map_jaxpr=private_copy(m.index_map_jaxpr))  # type: ignore[type-var]
            if dataclasses.is_dataclass(m) and hasattr(m, "index_map_jaxpr")
            else m
            for m in mappings
        )
        private["grid_mapping"] = dataclasses.replace(grid_mapping, block_mappings=copied)  # type: ignore[type-var]
    return private


def _jaxpr_like(value: Any) -> bool:
    return hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")


def lowers_for_cpu(primitive: Any, registry: LoweringRegistry) -> bool:
    """Whether JAX has a lowering rule for ``primitive`` on the CPU (its own or a common one)."""
    return primitive in registry.cpu or primitive in registry.common


def equation_context(eqn: Any) -> contextlib.AbstractContextManager[Any]:
    """The context an equation lowers in (compute type, metadata), as ``jaxpr_subcomp`` enters it."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def lowering_context_key(avals: Any, eqn_context: Any) -> tuple[Any, ...]:
    """What of an equation's lowering may shape a trace inside it: its argument avals and context."""
    return (tuple(avals), eqn_context)


def manual_axes(ctx: Any) -> bool:
    """Whether a rule context lowers inside a ``shard_map`` body (an SPMD axis context)."""
    axis_context = getattr(getattr(ctx, "module_context", None), "axis_context", None)
    return type(axis_context).__name__ not in ("ShardingContext", "ReplicaAxisContext")
