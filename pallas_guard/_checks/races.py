"""The ``races`` check: DMAs in flight while their buffers are read or written.

An output block that more than one iteration of a grid axis declared parallel writes is a race on a
chip whose TensorCores split that axis: decided from the output index maps, before the kernel runs.
A kernel on one core stays in the plain interpreter, where the check is made inside the plain
interpretation (``dma_races``, lowered by ``checked_plain``). A kernel in TPU interpret mode (chosen
for it, or forced) or in the Mosaic-GPU interpreter runs with that interpreter's detector on
(``interpreters.candidates``); after the run, the detector's verdict becomes a finding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np

from pallas_guard._checks import dma_races as _dma_races
from pallas_guard._checks import on_numbers
from pallas_guard._checks import protocol as _checks
from pallas_guard._checks.checked_plain import Active, PlainLowering, TableEntry, check_vector, site_text
from pallas_guard._checks.dma_jaxpr import has_dmas
from pallas_guard._checks.dma_table import Instrumented, Unsupported
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._jax import state as jax_state
from pallas_guard._jax import tracing as jax_tracing
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.errors import PallasGuardError
from pallas_guard_autoload import DEVICES

if TYPE_CHECKING:
    from pallas_guard._guard.engine import Run


class Races(_checks.Check):
    name = "races"
    order = 3
    in_plain = True

    def arm_plain(self, lowering: PlainLowering) -> Active | None:
        """The kernel traced again with its DMA table; None where its DMAs cannot race (decided
        while tracing) or cannot be followed (its decision says why)."""
        split = split_between_cores(lowering.given)
        if split is not None:
            source = _settings.stated("checks")
            error = _diagnostics.core_split_race(
                split, kernel=lowering.kernel, call_site=lowering.call_site, source=source
            )
            raise _checks.found(self.name, error, kernel=lowering.kernel, call_site=lowering.call_site)
        waits = _waits_on_semaphores(lowering)
        if not has_dmas(lowering.params["jaxpr"]):
            return waits
        races = Instrumented()
        try:
            lowering.params = _dma_races.instrument(lowering.params, races)
        except Unsupported as why:
            kernel, call_site = lowering.kernel, lowering.call_site
            note = f"runs unchecked: races could not be checked: {why}"
            _record.annotate(
                kernel, call_site, _checks.unchecked("races", str(why), kernel=kernel, call_site=call_site, note=note)
            )
            return None
        if not races.points:  # race-free whichever way it runs, decided while tracing
            return waits
        lowering.state[self.name] = races
        return waits or contextlib.nullcontext

    def plain_finding(
        self, message: str, lowering: PlainLowering, source: str, call_site: _diagnostics.CallSite
    ) -> PallasGuardError | None:
        if message.startswith(_WAIT):
            held, wanted = (int(n) for n in message[len(_WAIT) :].split(maxsplit=2)[:2])
            site = message[len(_WAIT) :].split(maxsplit=2)[2]
            return _diagnostics.semaphore_hang(
                site, held=held, wanted=wanted, kernel=lowering.kernel, call_site=call_site, source=source
            )
        races = lowering.state.get(self.name)
        if races is None or not _dma_races.is_race(message):
            return None
        what, text = _dma_races.describe(message, races)
        return _diagnostics.race_finding(text, what=what, kernel=lowering.kernel, call_site=call_site, source=source)

    def before(self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _checks.Prepared | None:
        if run.candidates.detect_races and "tpu" in run.candidates.names:
            _judge_waits_across_cores(run.hooks)
        return None

    def after(self, run: Run, out: Any, interpreter: str) -> None:
        # Only the interpreter that ran with the detector has a race state to read: a kernel the
        # detector could not take (plain, forced or chosen) has none.
        if run.candidates.detect_races and interpreter in ("tpu", "gpu"):
            check(out, kernel=run.kernel.info, call_site=run.call_site, interpreter=interpreter)


# --- a semaphore wait no core will signal, in TPU interpret mode --------------------------------------
# Each simulated core (and device) of TPU interpret mode runs in a thread of its own, and a wait on a
# semaphore blocks it until the count is there: a wait no other core will ever signal hangs the
# process, as the TPU would hang. While the detector runs, a regular semaphore's wait is judged: once
# every core of the kernel waits for a count that is not there or has finished the kernel, and stays
# so, none is left to signal. The waits are then let go (the kernel ends; its outputs are dropped) and
# the check reports it. A DMA semaphore is judged where DMAs execute as they start (a kernel that talks
# to other devices); with JAX's default order the wait runs the copies it waits for itself.


class _Hang(NamedTuple):
    device: int
    core: int
    wanted: int
    held: int


_STUCK_FOR = 0.25  # seconds every core must stay waiting, nothing changing, before it is judged a hang
_waiting_lock = threading.Lock()
_waiting: dict[int, dict[int, tuple[Any, int]]] = {}
"""Per interpreter state (by id): core -> (its semaphore's counts, what it waits for)."""
_let_go: set[int] = set()
"""Interpreter states (by id) whose waits were found hanging and are let go."""
_hangs: list[_Hang] = []
_changes = itertools.count()
_last_change = [0]


def _judge_waits_across_cores(hooks: list[Any]) -> None:
    from pallas_guard._vocabulary.patch import wrap

    semaphore = jax_pallas.semaphore_class("tpu")
    if semaphore is None:
        return
    before = len(hooks)
    wrap(semaphore, "wait", _judged_semaphore_wait, hooks, is_ours=lambda f: getattr(f, "pallas_guard_waits", False))
    if len(hooks) > before:  # wrapped now: what it judged is forgotten when it is put back
        hooks.insert(before, _ForgetWaits())


class _ForgetWaits:
    """On uninstall: hangs not yet reported, and waits under way, are dropped (no later install's
    kernel is reported for them)."""

    @staticmethod
    def restore() -> None:
        with _waiting_lock:
            _hangs.clear()
            _waiting.clear()
            _let_go.clear()


def _judged_semaphore_wait(wait: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wait)
    def pallas_guard_wait(self: Any, value: Any, global_core_id: Any, *args: Any, **kwargs: Any) -> Any:
        view = jax_pallas.semaphore_view(self)
        of_a_dma = bool(args or kwargs.get("has_tasks") or kwargs.get("is_dma"))
        if view is None or not jax_pallas.guards_state("tpu", view.state):  # a kernel you run there yourself
            return wait(self, value, global_core_id, *args, **kwargs)
        if of_a_dma and not view.dmas_at_start:  # the wait runs the DMAs it waits for
            return wait(self, value, global_core_id, *args, **kwargs)
        if not _until_held(self, view, int(value), int(global_core_id)):
            return None  # let go: no core will signal it
        return wait(self, value, global_core_id, *args, **kwargs)

    pallas_guard_wait.pallas_guard_waits = True  # type: ignore[attr-defined]
    return pallas_guard_wait


def _until_held(semaphore: Any, view: jax_pallas.SemaphoreView, wanted: int, core: int) -> bool:
    """Block until the semaphore holds ``wanted`` for ``core`` (True), or every core of the kernel
    is stuck (False: the hang was recorded, the wait is let go)."""
    state = id(view.state)
    stuck_since: tuple[int, float] | None = None
    try:
        while True:
            with semaphore.cv:
                if view.counts[core] >= wanted:
                    return True
                semaphore.cv.wait(timeout=0.02)
                if view.counts[core] >= wanted:
                    return True
            with _waiting_lock:
                if state in _let_go:
                    return False
                waiting = _waiting.setdefault(state, {})
                if core not in waiting:
                    waiting[core] = (view.counts, wanted)
                    _last_change[0] = next(_changes)
                finished = jax_pallas.cores_finished(view.state)
                everyone = finished is not None and len(waiting) + finished >= int(view.state.num_cores)
                if not everyone or any(counts[c] >= w for c, (counts, w) in waiting.items()):
                    stuck_since = None
                    continue
                now = time.monotonic()
                if stuck_since is None or stuck_since[0] != _last_change[0]:
                    stuck_since = (_last_change[0], now)
                elif now - stuck_since[1] >= _STUCK_FOR:
                    _let_go.add(state)
                    per_device = int(getattr(view.state, "num_cores_per_device", 1))
                    _hangs.extend(
                        _Hang(c // per_device, c % per_device, w, int(counts[c]))
                        for c, (counts, w) in sorted(waiting.items())
                    )
                    return False
    finally:
        with _waiting_lock:
            still = _waiting.get(state)
            if still is not None and still.pop(core, None) is not None:
                _last_change[0] = next(_changes)
                if not still:
                    del _waiting[state]
                    _let_go.discard(state)


def _taken_hangs() -> list[_Hang]:
    with _waiting_lock:
        taken = list(_hangs)
        _hangs.clear()
    return taken


# --- a semaphore wait no signal satisfies --------------------------------------------------------------

_WAIT = "pallas_guard semaphore wait "
_judging_waits: contextvars.ContextVar[bool] = contextvars.ContextVar("pallas_guard_waits", default=False)


def _waits_on_semaphores(lowering: PlainLowering) -> Active | None:
    """Where the kernel waits on a semaphore: its waits judged while it is discharged (a wait for
    more than the semaphore holds: one core has nothing else that could signal it)."""
    found = jax_pallas.semaphore_wait()
    if found is None or not any(
        eqn.primitive is found[0] for eqn in jax_state.jaxpr_equations(lowering.given["jaxpr"])
    ):
        return None
    with _hooking:
        for registry in jax_state.discharge_registries():
            rule = registry.rules.get(found[0])
            if rule is not None and registry.leading in (1, 2) and not getattr(rule, "pallas_guard_checking", False):
                wrapper = _judging_wait(rule, found[1], registry.leading)
                registry.rules[found[0]] = wrapper
                lowering.hooks.append(TableEntry(registry.rules, found[0], rule, wrapper))
    return _judging


@contextlib.contextmanager
def _judging() -> Iterator[None]:
    token = _judging_waits.set(True)
    try:
        yield
    finally:
        _judging_waits.reset(token)


_hooking = threading.Lock()


def _judging_wait(rule: Callable[..., Any], read: Callable[..., Any], leading: int) -> Callable[..., Any]:
    def pallas_guard_checked_wait(*args: Any, **params: Any) -> Any:
        if _judging_waits.get():
            from jax import lax

            # (a discharge context, operands...) from jax 0.11; (in_avals, out_avals, operands...) before.
            in_avals = args[0].in_avals if leading == 1 else args[0]
            ref, transforms, value, _ = params["args_tree"].unflatten(args[leading:])
            held = lax.convert_element_type(read(ref, transforms, in_avals[0]), "int32")
            wanted = lax.convert_element_type(value, "int32")
            site = site_text().replace("{", "{{").replace("}", "}}")
            # On one core nothing but the kernel signals a semaphore: what it holds now is all it gets.
            both = lax.concatenate([lax.reshape(held, (1,)), lax.reshape(wanted, (1,))], 0)
            check_vector(lax.ge(held, wanted), _WAIT + "{} {} " + site, both)
        return rule(*args, **params)

    pallas_guard_checked_wait.pallas_guard_checking = True  # type: ignore[attr-defined]
    return pallas_guard_checked_wait


# --- an output block written across a parallel grid axis ----------------------------------------------


def split_between_cores(params: Mapping[str, Any]) -> _diagnostics.CoreSplit | None:
    """The first output block that iterations with different values of a grid axis declared
    ``"parallel"`` or ``"core_parallel"`` both visit, or None: on a chip with two TensorCores each
    core takes a share of such an axis and writes its own copy of the block back."""
    semantics = jax_pallas.dimension_semantics(params)
    grid = jax_pallas.equation_grid(params)
    maps = jax_pallas.output_index_maps(params)
    if not semantics or grid is None or maps is None or not all(isinstance(n, int) for n in grid):
        return None
    split = [a for a, word in enumerate(semantics) if a < len(grid) and "parallel" in word and grid[a] > 1]
    if not split or math.prod(grid) > on_numbers.GRID_POINTS:
        return None
    points = np.indices(grid, dtype=np.int32).reshape(len(grid), -1)
    for output, closed in enumerate(maps):
        at_steps = on_numbers.at_every_step(closed, grid)
        if at_steps is None:
            continue
        blocks = np.stack([index.reshape(-1) for index in at_steps], axis=1)
        _, block_of = np.unique(blocks, axis=0, return_inverse=True)
        block_of = block_of.reshape(-1)
        for axis in split:
            # Per block, the distinct values of the axis that visit it: more than one is a revisit
            # across the axis.
            pairs = np.unique(np.stack([block_of, points[axis]], axis=1), axis=0)
            blocks_seen, counts = np.unique(pairs[:, 0], return_counts=True)
            shared = blocks_seen[counts > 1]
            if len(shared):
                first = int(np.argmax(block_of == shared[0]))
                values = sorted({int(v) for v in points[axis][block_of == shared[0]]})
                return _diagnostics.CoreSplit(
                    output=output,
                    block=tuple(int(i) for i in blocks[first]),
                    axis=axis,
                    semantics=semantics[axis],
                    values=tuple(values),
                    chips=tuple(
                        name for name, (_, cores, platform) in DEVICES.items() if platform == "tpu" and cores > 1
                    ),
                )
    return None


def check(out: Any, *, kernel: _diagnostics.KernelInfo, call_site: _diagnostics.CallSite, interpreter: str) -> None:
    """Raise the finding if the interpreter found a race running the kernel.

    Run eagerly, the kernel has finished when this returns and the finding is raised here; traced
    (under jit), a callback that depends on the kernel's output reads the detector's verdict after
    the kernel ran and records the finding, which the jitted call raises. Raised there, it stops the
    computation before the interpreter's own clean-up (ordered after the outputs): the guard resets
    the interpreter first, so the next kernel starts clean.
    """
    import jax

    def finding() -> PallasGuardError | None:
        hangs = _taken_hangs()
        if not hangs and not jax_pallas.races_found(interpreter):
            return None
        jax_pallas.reset_interpreter(interpreter)
        if hangs:
            source = _settings.stated("checks")
            error = _diagnostics.semaphore_hang(
                ", ".join(f"of device {h.device} core {h.core} for {h.wanted} (it holds {h.held})" for h in hangs),
                held=hangs[0].held,
                wanted=hangs[0].wanted,
                kernel=kernel,
                call_site=call_site,
                source=source,
                across=True,
            )
        else:
            error = _diagnostics.race_error(kernel=kernel, call_site=call_site, interpreter=interpreter)
        return _checks.found("races", error, kernel=kernel, call_site=call_site, interpreter=interpreter)

    leaves = jax.tree_util.tree_leaves(out)
    if not leaves:
        return
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        jax.block_until_ready(out)  # type: ignore[no-untyped-call]
        found = finding()
        if found is not None:
            raise found
        return
    mesh = jax_tracing.manual_mesh()
    devices = math.prod(mesh[1]) if mesh is not None else 1
    if devices > 1:
        # Inside shard_map each device runs the kernel in a thread of its own, and TPU interpret
        # mode waits for all of them at the end: a callback that raised would leave the others
        # waiting for ever. The callback is ordered after the kernel's own last one (each device's
        # passes that wait): the first device there reads the verdict, complete, before any device
        # starts another kernel; the finding is raised once the computation is done.
        gate = _findings.await_gate()
        arrivals = itertools.count()
        lock = threading.Lock()

        def read(*_: Any) -> np.int32:
            with lock:
                if next(arrivals) % devices == 0:
                    found = finding()
                    _findings.hand_over(gate, None if found is None else functools.partial(_raise, found))
            return np.int32(0)

        from jax.experimental import io_callback

        scalar = jax.ShapeDtypeStruct((), np.int32)  # type: ignore[no-untyped-call]
        io_callback(read, scalar, leaves[0], ordered=True)
        return

    def record_if_race(*_: Any) -> None:
        found = finding()
        if found is not None:
            _findings.record(found)

    jax.debug.callback(record_if_race, leaves[0])


def _raise(error: PallasGuardError) -> NoReturn:
    raise error


CHECK = Races()
