"""Pallas's internals: its primitives, interpreters, backends and the plain interpreter's pieces."""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pallas_guard._jax.lookup import first_attribute, import_optional, note_missing


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


def equation_family(params: Mapping[str, Any]) -> str | None:
    """The backend a kernel equation was written for, from its ``compiler_params`` (an object from
    jax 0.9.1, a Mapping keyed by backend before)."""
    compiler_params = params.get("compiler_params")
    if isinstance(compiler_params, Mapping):
        return next((BACKEND_NAMES.get(str(key)) for key in compiler_params), None)
    return backend_family(compiler_params) if compiler_params is not None else None


def equation_grid(params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The grid of a ``pallas_call_p`` equation (its ``grid_mapping``); None for ``mpmd_map_p``."""
    grid_mapping = params.get("grid_mapping")
    grid = getattr(grid_mapping, "grid", None)
    return tuple(grid) if grid is not None else None


def semaphore_wait() -> tuple[Any, Callable[..., Any]] | None:
    """(JAX's ``semaphore_wait`` primitive, its reader of a semaphore's value in a discharge rule:
    ``read(ref, transforms, aval)``), or None where this jax lacks either."""
    module = "jax._src.pallas.primitives"
    primitive = first_attribute([(module, "semaphore_wait_p")])
    read = first_attribute([(module, "_transform_semaphore")])
    if primitive is None or read is None:
        note_missing("semaphore_wait_p/_transform_semaphore", "the races check does not judge semaphore waits")
        return None
    return primitive, read


def dimension_semantics(params: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The TPU ``dimension_semantics`` of a kernel equation, as lower-case words (``"parallel"``,
    ``"arbitrary"``, ``"core_parallel"``: strings or enum members by version); None where unset."""
    compiler_params = params.get("compiler_params")
    found = compiler_params.values() if isinstance(compiler_params, Mapping) else (compiler_params,)
    for value in found:
        semantics = value.get("dimension_semantics") if isinstance(value, Mapping) else None
        semantics = semantics or getattr(value, "dimension_semantics", None)
        if semantics:
            return tuple(str(getattr(s, "name", s)).lower().rpartition(".")[2] for s in semantics)
    return None


def output_index_maps(params: Mapping[str, Any]) -> list[Any] | None:
    """The closed index-map jaxprs of a ``pallas_call_p`` equation's outputs (grid indices in, a
    block index out); None where the equation has no grid mapping or its maps read operands (scalar
    prefetch: the block depends on the data)."""
    mapping = params.get("grid_mapping")
    mappings = getattr(mapping, "block_mappings", None)
    if mappings is None or getattr(mapping, "num_index_operands", None):
        return None
    first = int(getattr(mapping, "num_inputs", 0))
    outputs = list(mappings)[first : first + int(getattr(mapping, "num_outputs", 0))]
    maps = [getattr(block, "index_map_jaxpr", None) for block in outputs]
    return None if any(m is None for m in maps) else maps


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


# Where each interpreter keeps its global simulated state: the module with ``_shared_memory`` and
# ``_initialize_shared_memory`` (which every simulated device calls once as a kernel starts).
_SHARED_STATES = {
    "tpu": ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic.interpret"),
    "gpu": ("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks",),
}


GUARDS_RUN = "pallas_guard_run"
"""Set on the ``interpret=`` objects the guard makes: the interpreter states made from them are its own."""
_guards_states: dict[str, Any] = {}


def _state_module(interpreter: str) -> types.ModuleType | None:
    return next((m for m in map(import_optional, _SHARED_STATES.get(interpreter, ())) if m is not None), None)


class _ForgetGuardsState:
    """On uninstall: the state the guard's last run made is no longer held (nor told apart)."""

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter

    def restore(self) -> None:
        _guards_states.pop(self.interpreter, None)


def guards_state(interpreter: str, state: Any) -> bool:
    """Whether ``state`` is that of a run the guard made (not one of a kernel you run there yourself)."""
    return state is not None and _guards_states.get(interpreter) is state


def start_each_run_clean(interpreter: str, hooks: list[Any]) -> None:
    """Make every later run of ``interpreter`` start from a fresh state, as JAX's own clean-up
    leaves it when a kernel returns.

    A kernel that fails leaves the interpreter's state behind, and JAX's initialisation reuses a
    state it finds: the next kernel ran with the old settings, race detection off included, so a
    race asked for was silently not looked for. A state is left over once as many devices as it
    simulates have started on it (each starts once per run), or when it was made by a run this
    wrapper never saw. The entry added to ``hooks`` puts JAX's function back."""
    from pallas_guard._vocabulary.patch import wrap

    module = _state_module(interpreter)
    if module is None or not callable(vars(module).get("_initialize_shared_memory")):
        note_missing(f"{interpreter.upper()} interpret mode state", "a kernel after a failed one may run unchecked")
        return
    watched: list[Any] = [None, 0]  # the state this wrapper saw made, and how many devices started on it
    lock = threading.Lock()

    def starting_clean(initialize: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(initialize)
        def pallas_guard_initialize(*args: Any, **kwargs: Any) -> Any:
            with lock:
                state = vars(module).get("_shared_memory")
                if state is not None and (state is not watched[0] or watched[1] >= getattr(state, "num_devices", 1)):
                    reset_interpreter(interpreter)
                result = initialize(*args, **kwargs)
                state = vars(module).get("_shared_memory")
                watched[:] = [state, watched[1] + 1 if state is watched[0] else 1]
                ours = getattr(kwargs.get("interpret_params"), GUARDS_RUN, False) is True
                _guards_states[interpreter] = state if ours else None
            return result

        pallas_guard_initialize.pallas_guard_fresh_state = True  # type: ignore[attr-defined]
        return pallas_guard_initialize

    before = len(hooks)
    wrap(
        module,
        "_initialize_shared_memory",
        starting_clean,
        hooks,
        is_ours=lambda f: getattr(f, "pallas_guard_fresh_state", False) is True,
    )
    if len(hooks) > before:  # wrapped now: forgotten when it is put back
        hooks.insert(before, _ForgetGuardsState(interpreter))


def semaphore_class(interpreter: str = "tpu") -> type | None:
    """TPU interpret mode's simulated semaphore (its ``wait(value, global_core_id, ...)``)."""
    if interpreter != "tpu":
        return None
    found = first_attribute(
        [
            ("jax._src.pallas.mosaic.interpret.shared_memory", "Semaphore"),  # 0.8.0+
            ("jax._src.pallas.mosaic.interpret", "Semaphore"),  # 0.6.2 - 0.7.x
        ]
    )
    return found if isinstance(found, type) and callable(vars(found).get("wait")) else None


class SemaphoreView(NamedTuple):
    """What a waiting core's semaphore and its interpreter state say, read without JAX's locks."""

    counts: Any
    """Per global core, what the semaphore holds."""
    state: Any
    """The interpreter's shared state the semaphore belongs to."""
    dmas_at_start: bool
    """DMAs executed when they start: nothing but a core's own actions signals a semaphore (with
    JAX's default order, a DMA semaphore's wait runs the copies it waits for itself)."""


def semaphore_view(semaphore: Any, interpreter: str = "tpu") -> SemaphoreView | None:
    """``semaphore``'s counts and state where this jax keeps them as the guard knows (0.7 - 0.12),
    and the state detects races; None otherwise."""
    counts = getattr(semaphore, "count_by_core", None)
    if counts is None:
        counts = getattr(semaphore, "counts", None)
    state = getattr(semaphore, "shared_memory", None)
    if state is None:  # 0.7.x: one state, module-wide
        module = _state_module(interpreter)
        state = vars(module).get("_shared_memory") if module is not None else None
    if counts is None or state is None:
        return None
    params = getattr(state, "interpret_params", None)  # 0.7.x keeps the options there
    detects = getattr(state, "detect_races", getattr(params, "detect_races", False))
    mode = getattr(state, "dma_execution_mode", getattr(params, "dma_execution_mode", None))
    return SemaphoreView(counts, state, mode == "eager") if detects else None


def cores_finished(state: Any) -> int | None:
    """How many simulated cores of ``state`` have finished the kernel (their device waits at the
    end for the others); None where this jax does not say."""
    barrier = getattr(state, "clean_up_barrier", None)
    per_device = getattr(state, "num_cores_per_device", None)
    waiting = getattr(barrier, "n_waiting", None)
    return None if waiting is None or per_device is None else int(waiting) * int(per_device)


def races_found(interpreter: str = "tpu") -> bool | None:
    """Whether ``interpreter``'s race detector flagged the last kernel; None if unknown."""
    for module_name, attribute in _RACE_STATES.get(interpreter, ()):
        module = import_optional(module_name)
        if module is not None and hasattr(module, attribute):
            return bool(getattr(getattr(module, attribute), "races_found", False))
    note_missing(f"{interpreter.upper()} interpret mode race state", "races cannot be reported as PallasGuardError")
    return None


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


def plain_interpreter(params: Mapping[str, Any]) -> Callable[..., Any] | None:
    """What ``_pallas_call_lowering`` lowers with ``mlir.lower_fun`` for ``interpret=True``: the HLO
    interpreter with the equation's other params (``backend`` among them before jax 0.9.1); None
    where this jax lacks it, or where JAX's rule raises before interpreting (constants)."""
    interpret = getattr(hlo_interpreter_module(), "pallas_call_hlo_interpret", None)
    jaxpr = params.get("jaxpr")
    if interpret is None or getattr(jaxpr, "constvars", True):
        return None
    return functools.partial(interpret, **{k: v for k, v in params.items() if k != "interpret"})
