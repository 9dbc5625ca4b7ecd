"""Kernel facts, call sites, and the one message builder behind every warning and error."""

from __future__ import annotations

import functools
import os
import re
import sys
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from pallas_guard._deciding import facts as _facts
from pallas_guard._deciding import interpreters as _interpreters
from pallas_guard._deciding.target import Target, accelerator_evidence
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import source as jax_source
from pallas_guard._vocabulary.enums import Policy
from pallas_guard._vocabulary.errors import PallasGuardError, PallasGuardWarning
from pallas_guard._vocabulary.record import size
from pallas_guard._vocabulary.settings import Setting, current, how_to_set
from pallas_guard_autoload import CHECKS_ENV, INTERPRETER_ENV, printable


class KernelInfo(NamedTuple):
    name: str
    defined_at: str | None
    entry_point: str


def _code_location(function: Any) -> str | None:
    code = getattr(function, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else None


def kernel_from_callable(kernel: object, *, entry_point: str, name: object = None) -> KernelInfo:
    """Facts about a kernel body the user handed to an entry point."""
    function = _facts.innermost_function(kernel)
    label = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if isinstance(name, str) and name:
        label = f"{name} ({label})" if label and label != name else name
    return KernelInfo(str(label or "<unnamed kernel>"), _code_location(function), entry_point)


_SRC_INFO = re.compile(r"^(?P<name>.*?) at (?P<location>.+:\d+)$")


def traced_function(jaxpr: Any) -> tuple[str | None, str | None]:
    """``(name, file:line)`` of the Python function a (closed) jaxpr was traced from, as its debug
    info says; ``(None, None)`` where it says nothing."""
    debug_info = getattr(jaxpr, "debug_info", None) or getattr(getattr(jaxpr, "jaxpr", None), "debug_info", None)
    match = _SRC_INFO.match(str(getattr(debug_info, "func_src_info", "") or ""))
    return (match["name"], match["location"]) if match else (None, None)


def kernel_from_params(params: Mapping[str, Any], *, entry_point: str) -> KernelInfo:
    """Facts about a kernel from its equation's parameters (the lowering net's only source)."""
    jaxpr = params.get("jaxpr")
    if jaxpr is None and params.get("jaxprs"):
        jaxpr = params["jaxprs"][0]
    label, location = traced_function(jaxpr)
    name = params.get("name")
    if name_and_src := params.get("name_and_src_info"):
        name = getattr(name_and_src, "name", name)
    if isinstance(name, str) and name:
        label = f"{name} ({label})" if label and label != name else name
    return KernelInfo(label or "<unnamed kernel>", location, entry_point)


# --- call sites ---------------------------------------------------------------------------------


class CallSite(NamedTuple):
    """Where the user called a kernel: their own line, and the library line in between, if any."""

    user: str | None
    """``file:line`` of the first frame in the user's own code (else the innermost non-jax frame)."""
    via: str | None = None
    """``file:line`` of the innermost library frame, when a library called the entry point."""

    def __str__(self) -> str:
        return (self.user or "?") + (f" (via {self.via})" if self.via else "")

    @property
    def is_users(self) -> bool:
        """Whether ``user`` is a frame of the user's own code (not a fallback to a library frame)."""
        return self.user is not None and frame_kind(self.user.rpartition(":")[0]) == "user"


NOWHERE = CallSite(None)


@functools.lru_cache(maxsize=1)
def _internal_prefixes() -> tuple[str, ...]:
    prefixes = [jax_source.PACKAGE_DIR + os.sep, "<frozen"]
    for name in ("jax", "jaxlib", "wrapt", "pallas_guard_autoload"):
        module_file = getattr(sys.modules.get(name), "__file__", None)
        if module_file:
            # A package's directory; a single-file module's own file.
            package = os.path.basename(module_file) == "__init__.py"
            prefixes.append(os.path.dirname(os.path.abspath(module_file)) + os.sep if package else module_file)
    return tuple(prefixes)


@functools.lru_cache(maxsize=1)
def _installed_prefixes() -> tuple[str, ...]:
    """Where installed distributions and the standard library live: not the user's code."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    directories = [paths.get(key) for key in ("purelib", "platlib", "stdlib", "platstdlib")]
    directories += list(getattr(site, "getsitepackages", list)())
    return tuple(os.path.abspath(d) + os.sep for d in directories if d)


_INSTALLED_MARKERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


@functools.lru_cache(maxsize=4096)
def frame_kind(filename: str) -> Literal["internal", "library", "user"]:
    """``internal`` (jax, pallas_guard, wrapt), ``library`` (an installed distribution or the
    standard library) or ``user`` (everything else: the user's own code)."""
    if filename.startswith(_internal_prefixes()):
        return "internal"
    if any(marker in filename for marker in _INSTALLED_MARKERS):
        return "library"
    if os.path.abspath(filename).startswith(_installed_prefixes()):
        return "library"
    return "user"


def call_site_of(frames: Iterable[tuple[str, int]]) -> CallSite:
    """The call site from ``(file, line)`` frames, innermost first: the first user frame, with the
    innermost library frame beside it; the innermost non-internal frame when none is the user's."""
    via = None
    for filename, line in frames:
        kind = frame_kind(filename)
        if kind == "user":
            return CallSite(f"{filename}:{line}", via)
        if kind == "library" and via is None:
            via = f"{filename}:{line}"
    return CallSite(via) if via is not None else NOWHERE


def _python_frames(frame: types.FrameType | None) -> Iterator[tuple[str, int]]:
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


def user_call_site() -> CallSite:
    """The call site on the current Python stack."""
    return call_site_of(_python_frames(sys._getframe(1)))  # noqa: SLF001 - inspect.stack() reads source files


# --- messages -----------------------------------------------------------------------------------


def _describe(kernel: KernelInfo, call_site: CallSite) -> str:
    # Names and paths are the user's, not ours: escaped, so none can colour a log or forge a line.
    defined = f" (defined at {printable(kernel.defined_at)})" if kernel.defined_at else ""
    called = f", called at {printable(str(call_site))}," if call_site.user else ""
    name = printable(repr(kernel.name))
    return f"Pallas kernel {name} (built with {kernel.entry_point}){defined}{called}".rstrip(",")


_DECIDED = {
    "front door": "decided when the kernel was called, before JAX traced it",
    "lowering": "decided when JAX lowered the kernel for the CPU",
}


def reason_sentence(reason: str, layer: str) -> str:
    """Why the guard did what it did with one kernel: the one sentence ``repr(Decision)``, pytest's
    details and summary print; the layer said in words, not in the guard's own vocabulary."""
    return printable(f"{reason}; {_DECIDED.get(layer, layer)}")


def message(
    *,
    refused: bool,
    kernel: KernelInfo,
    call_site: CallSite,
    target: Target,
    policy: Setting[Policy],
    interpreter: str | None = None,
    failure: str | None = None,
    race: bool = False,
    why_interpreter: str | None = None,
) -> str:
    """The one message builder: what happened, why the target is the CPU, how to change it.

    Variants: refused (strict), interpreted (warn), ``failure`` (the chosen interpreter cannot run
    the kernel on the CPU, and why) and ``race`` (TPU interpret mode's race detector fired).
    """
    what = _describe(kernel, call_site)
    tried = _interpreters.describe_interpreter(interpreter or "plain")
    if race:
        head = (
            f"pallas_guard: a data race was detected in {what}, run in {tried} with race detection "
            f"({CHECKS_ENV}=races); the detector's RACE DETECTED report above names the buffers."
        )
        checks = current("checks")
        return "\n".join([head, f"To run without race detection: {how_to_set('checks', 'none', checks.source)}."])
    if failure is not None:
        chosen = f" (chosen because: {why_interpreter})" if why_interpreter else ""
        lines = [
            f"pallas_guard: {what} cannot run on the CPU: the guard tried {tried}{chosen}, and {failure}.",
            "Why the target is the CPU: " + "; ".join(target.evidence) + ".",
            *accelerator_evidence(),
            "To fix: run it where a GPU/TPU backend is available; or force another interpreter: "
            f"{how_to_set('interpreter', 'plain|tpu|gpu', current('interpreter').source)} (auto chooses per "
            f"kernel); or {how_to_set('policy', 'strict', policy.source)} to fail before tracing.",
        ]
        return "\n".join(lines)
    if refused:
        head = (
            f"pallas_guard: {what} would lower for the CPU without interpret=, where JAX supports "
            "only interpret mode (policy 'strict')."
        )
    else:
        head = (
            f"pallas_guard: {what} is lowering for the CPU, so it runs with the "
            f"{interpreter or 'plain'} interpreter (policy 'warn')."
        )
    lines = [head, "Why the target is the CPU: " + "; ".join(target.evidence) + "."]
    lines.extend(accelerator_evidence())
    lines.append(f"Policy {policy.value.value!r} came from {policy.source}.")
    # interpret= can only be passed where pallas_call is called: not inside a library.
    yourself = (
        f"the call is made by the library at {printable(call_site.via)}, so set the policy rather than interpret="
        if call_site.via
        else "or pass interpret=True to the kernel yourself"
    )
    if refused:
        lines.append(
            f"To fix: {how_to_set('policy', 'interpret', policy.source)} (or warn) to run it interpreted "
            f"({yourself}); or run where a GPU/TPU backend is available."
        )
    else:
        lines.append(
            f"To silence: {how_to_set('policy', 'interpret', policy.source)}; to fail instead: "
            f"{how_to_set('policy', 'strict', policy.source)} ({yourself})."
        )
    return "\n".join(lines)


def refusal(*, kernel: KernelInfo, call_site: CallSite, target: Target, policy: Setting[Policy]) -> PallasGuardError:
    return PallasGuardError(message(refused=True, kernel=kernel, call_site=call_site, target=target, policy=policy))


def interpreter_failure(
    error: BaseException,
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    target: Target,
    policy: Setting[Policy],
    interpreter: str,
    family: str | None,
    why: str | None = None,
) -> str | None:
    """A note explaining ``error`` when the CPU or the interpreter caused it, else None (the kernel's
    own bugs are not explained away). The error keeps its type: the note goes on it (PEP 678)."""
    failure = _interpreters.explain_failure(error, interpreter=interpreter, family=family)
    if failure is None:
        return None
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=target,
        policy=policy,
        interpreter=interpreter,
        failure=failure,
        why_interpreter=why,
    )
    return text


def first_line(error: BaseException) -> str:
    """The line that says what went wrong: the first, or for an error that carries a Python
    traceback in its text (a failed host callback), the last."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("Traceback (most recent call last):"):
        return f"{type(error).__name__}: {lines[0].removesuffix('Traceback (most recent call last):')}{lines[-1]}"
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


def no_interpreter(
    failures: list[tuple[str, BaseException]],
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    target: Target,
    why: str,
) -> PallasGuardError:
    """No candidate interpreter runs ``kernel``: each one tried, with the first line of its error."""
    tried = [f"  - {_interpreters.describe_interpreter(name)}: {first_line(error)}" for name, error in failures]
    verdict = (
        "Each failure comes from inside JAX's interpreters: this looks like a gap in them for this kernel, "
        "not a bug in the kernel (report it to JAX, or to the kernel's authors)."
        if all(_interpreters.is_interpreter_gap(error) for _, error in failures)
        else "Not every failure comes from inside JAX's interpreters: the kernel itself may be at fault."
    )
    lines = [
        f"pallas_guard: no interpreter could run {_describe(kernel, call_site)} on the CPU. Tried, in order ({why}):",
        *tried,
        verdict,
        "Why the target is the CPU: " + "; ".join(target.evidence) + ".",
        *accelerator_evidence(),
        f"To force one interpreter: {INTERPRETER_ENV}=plain|tpu|gpu (or pallas_guard.policy(interpreter=...)); "
        "to skip this kernel on the CPU, run it where a GPU/TPU backend is available.",
    ]
    return PallasGuardError("\n".join(lines))


def unexportable(
    *, kernel: KernelInfo, call_site: CallSite, interpreter: str, why: str, tried: tuple[str, ...]
) -> PallasGuardError:
    """A kernel exported for the CPU that only an interpreter running on host callbacks can run."""
    tried_lines = [f"  - {line}" for line in tried]
    return PallasGuardError(
        "\n".join(
            [
                f"pallas_guard: {_describe(kernel, call_site)} cannot be exported for the CPU: it runs only in "
                f"{_interpreters.describe_interpreter(interpreter)} ({why}), which runs the kernel through host "
                "callbacks, and jax.export cannot serialize host callbacks.",
                *(["Tried:", *tried_lines] if tried_lines else []),
                "To fix: export for the accelerator the kernel is written for (platforms=['tpu'] or ['cuda']), "
                "and run the CPU version without exporting it.",
            ]
        )
    )


def plain_failed_at_lowering(kernel: KernelInfo, *, family: str | None) -> str:
    """The lowering net substituted the plain interpreter and it cannot lower this kernel."""
    other = "gpu" if family == "mosaic_gpu" else "tpu"
    return (
        f"pallas_guard: the plain interpreter, which the lowering net substituted for {_describe(kernel, NOWHERE)}, "
        f"cannot lower it; {_interpreters.describe_interpreter(other)} may run it. Another interpreter can only be "
        "chosen where the kernel is called with the CPU as target (here it was not: a kernel built before the "
        "guard was installed, a trace whose target was unknown, an export for several platforms). To force it: "
        f"{INTERPRETER_ENV}={other} (or pallas_guard.policy(interpreter={other!r}) around the call)."
    )


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (PEP 678), keeping its type: the user's handlers still match."""
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def runtime_failure_note(*, kernel: KernelInfo, interpreter: str, why: str, tried: list[tuple[str, str, str]]) -> str:
    """What the guard knows of a kernel that lowered in ``interpreter`` and then failed running."""
    lines = [
        f"pallas_guard: {_describe(kernel, NOWHERE)} failed while running in "
        f"{_interpreters.describe_interpreter(interpreter)}, the interpreter chosen for it ({why}).",
        *(f"  - {_interpreters.describe_interpreter(n)}: {when} ({first})" for n, first, when in tried),
        f"To force another interpreter: {INTERPRETER_ENV}=plain|tpu|gpu (or pallas_guard.policy(interpreter=...)); "
        "if the kernel comes from a library, it may have an interpret option of its own, which can build a "
        "kernel the interpreters run.",
    ]
    return "\n".join(lines)


def race_error(*, kernel: KernelInfo, call_site: CallSite, interpreter: str = "tpu") -> PallasGuardError:
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=Target("cpu", ()),
        policy=Setting(Policy.INTERPRET, "race detection"),
        interpreter=interpreter,
        race=True,
    )
    return PallasGuardError(text)


def over_budget(
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    grid: tuple[Any, ...],
    steps: int,
    interpreter: str,
    budget: Setting[int | None],
) -> PallasGuardError:
    """A kernel whose interpreted grid has more steps than the budget: not run."""
    error = PallasGuardError(
        f"pallas_guard: {_describe(kernel, call_site)} was not run: its grid {grid} has {steps} steps, "
        f"more than the step budget of {budget.value} (from {budget.source}) for kernels run in "
        f"{_interpreters.describe_interpreter(interpreter)}.\n"
        "To fix: use smaller shapes in this test, or larger blocks (fewer grid steps); or raise the "
        f"budget: {how_to_set('max_steps', steps, budget.source)}; in pytest, "
        "pallas_guard_over_budget = skip skips such tests instead."
    )
    error.pallas_guard_over_budget = True  # type: ignore[attr-defined]  # the pytest plugin skips on it
    return error


FINDING = "pallas_guard: an out-of-bounds "
"""How every bounds finding begins: found again in the text of the JAX error that carries it."""


def bounds_finding(
    finding: str,
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    what: str | None = None,
    source: str = f"{CHECKS_ENV}=bounds",
) -> PallasGuardError:
    """A bounds check found an access outside a buffer (the interpreter would have clamped it).
    ``finding`` says which access (``read [20:28] of a float32[24] buffer at k.py:9 (...)``); ``what``
    kind it is, where the finding does not begin with it."""
    if what is None:
        what = "block copy" if finding.startswith("block copy") else finding.split(" [", maxsplit=1)[0]
    return PallasGuardError(
        f"{FINDING}{what} in {_describe(kernel, call_site)}, found by the bounds check "
        f"({source}; the interpreter would have clamped it silently): {finding}"
    )


RACE_FINDING = "pallas_guard: a race ("
"""How every race finding of the plain interpretation begins."""


def race_finding(text: str, *, what: str, kernel: KernelInfo, call_site: CallSite, source: str) -> PallasGuardError:
    """The race check in the plain interpretation found a race (``text``: which DMA and which access,
    where, the region both touch); ``what`` kind of race it is."""
    return PallasGuardError(
        f"{RACE_FINDING}{what}) in {_describe(kernel, call_site)}, found by the races check ({source}; on a "
        f"CPU the plain interpreter copies a DMA's data when it starts, which hides it; on a TPU the kernel "
        f"reads or writes data the DMA has not finished moving): {text}\n"
        "To fix: wait on the DMA (`.wait()` on its descriptor) before touching the region it moves, and "
        "start it only after the last use of the region it overwrites."
    )


def semaphore_hang(
    site: str,
    *,
    held: int,
    wanted: int,
    kernel: KernelInfo,
    call_site: CallSite,
    source: str,
    across: bool = False,
) -> PallasGuardError:
    """A semaphore wait for more than the semaphore holds, on one core: no signal can come; or
    (``across``) the waits of every core of a kernel in TPU interpret mode, none left to signal."""
    if across:
        what = (
            f"the waits {site} in TPU interpret mode, where every core (and device) of the kernel waits "
            "or has finished it, so none is left to signal: on a TPU they wait forever (the guard let them "
            "go to report it, and the call's outputs are not returned)"
        )
    else:
        what = (
            f"the wait {site} needs {wanted} and the semaphore holds {held}, and on one core nothing else "
            "signals it: on a TPU the core waits forever (the interpreter returns at once)"
        )
    return PallasGuardError(
        f"{RACE_FINDING}a semaphore wait no signal satisfies) in {_describe(kernel, call_site)}, found by the "
        f"races check ({source}): {what}.\n"
        "To fix: signal the semaphore as often as the kernel waits on it (`pl.semaphore_signal` before "
        "`pl.semaphore_wait`, with the same counts), or wait for what was signalled."
    )


class CoreSplit(NamedTuple):
    """An output block visited by iterations of a grid axis that two TensorCores split."""

    output: int
    block: tuple[int, ...]
    axis: int
    semantics: str
    values: tuple[int, ...]
    """The values of the axis whose iterations visit the block."""
    chips: tuple[str, ...]
    """The TPU generations with two TensorCores per chip (the guard's device names)."""


def core_split_race(split: CoreSplit, *, kernel: KernelInfo, call_site: CallSite, source: str) -> PallasGuardError:
    """An output block written by more than one iteration of a grid axis declared parallel."""
    shown = ", ".join(map(str, split.values[:6])) + (", ..." if len(split.values) > 6 else "")
    return PallasGuardError(
        f"{RACE_FINDING}an output block written across a parallel grid axis) in {_describe(kernel, call_site)}, "
        f"found by the races check ({source}): output {split.output}'s block "
        f"({', '.join(map(str, split.block))}) is visited by the iterations with grid axis {split.axis} = {shown}, "
        f'an axis declared "{split.semantics}". A chip with two TensorCores ({", ".join(split.chips)}) splits that '
        f"axis between its cores, each core keeps its own copy of the block and writes it back, and one overwrites "
        f"the other; one core, and the interpreters, run the iterations in order and hide it.\n"
        f'To fix: declare grid axis {split.axis} "arbitrary" in dimension_semantics (its iterations then run in '
        f"order on one core), or give each of its iterations a block of its own in the output's index map."
    )


def disagreement(found: Any, *, kernel: KernelInfo, call_site: CallSite, compared: Iterable[str]) -> PallasGuardError:
    """Two interpreters ran the same kernel on the same inputs and returned different values where
    the kernel wrote (``found``: an ``_agree.Disagreement``)."""
    describe = _interpreters.describe_interpreter
    where = f" at [{', '.join(map(str, found.at))}]" if found.at else ""
    why = (
        f"it agrees with the majority of {', '.join(map(describe, compared))}"
        if found.majority
        else "no majority decides, and the plain interpreter simulates nothing"
    )
    return PallasGuardError(
        f"pallas_guard: interpreters disagree on {_describe(kernel, call_site)}, found by the agree check: "
        f"on the call's inputs, output {found.output}{where}, which the kernel wrote, is {found.first_value!r} in "
        f"{describe(found.first)} but {found.second_value!r} in {describe(found.second)}. One of JAX's "
        f"interpreters computes this kernel wrongly, or the kernel depends on what the interpreters leave "
        f"undefined (an uninitialised scratch buffer, a race). The guard now runs this kernel in "
        f"{describe(found.right)} ({why}); to choose yourself: {INTERPRETER_ENV}=plain|tpu|gpu."
    )


def lowering_refused(
    *,
    kernel: KernelInfo,
    call_site: CallSite,
    target: str,
    error: BaseException,
    source: str,
    check: str = "lowering",
    fix: str | None = None,
    step: str | None = None,
) -> PallasGuardError:
    """The kernel's real target refused it (``target``: the platform, the device and where it came
    from), in JAX's lowering or the target's compiler (``check``; ``step`` names who refused where
    it is neither JAX's lowering nor the TPU's compiler); the interpreted result is not
    returned. JAX's text is said once, here (the error is raised without its cause), cut to what
    names the cause: at most ``_REFUSAL_LINES`` lines, with a "To fix" where one can be computed."""
    said = _refusal_text(error)
    fix = fix or refusal_fix(error)
    step = step or f"{'JAX' if check == 'lowering' else 'the TPU compiler'}'s {check}"
    return PallasGuardError(
        f"pallas_guard: {_describe(kernel, call_site)} runs interpreted on the CPU, but its target refuses "
        f"it, found by the {check} check ({source}): "
        f"{step} for {target} raised {said}" + (f"\nTo fix: {fix}" if fix else "")
    )


def too_tight(*, kernel: KernelInfo, call_site: CallSite, uses: list[str], headroom: str, fix: str) -> PallasGuardError:
    """A kernel its target compiles with less memory to spare than the headroom setting asks (or,
    on a GPU, spilling registers)."""
    return PallasGuardError(
        f"pallas_guard: {_describe(kernel, call_site)} compiles with less memory to spare than the "
        f"headroom setting asks ({headroom}), found by the compile check: it takes {'; '.join(uses)}. "
        "A small change of shapes, of the compiler or of the chip refuses it (a spill: slows it)."
        f"\nTo fix: {fix}"
    )


def gpu_tight_fix(space: str, gpu: str) -> str:
    """What frees a GPU kernel's shared memory or registers before its compiler refuses it."""
    if space == "spill stores":
        return (
            f"ptxas ran out of registers on {gpu} and spilled to local memory: shrink the blocks each "
            "program holds at once, or raise num_warps so that each thread holds less"
        )
    return f"shrink the kernel's block shapes, or num_stages (that many copies of each block), to leave {gpu} headroom"


def tight_fix(space: str, generation: str, *, vmem_capacity: int | None) -> str:
    """What frees a VMEM limit the kernel nearly fills (the refusal's fix, before the refusal)."""
    if space == "VMEM scratch":
        return f"shrink the kernel's VMEM scratch (its scratch_shapes), held to {generation}'s whole VMEM"
    return f"{_raise_limit(generation, vmem_capacity)}, or {_SHRINK}"


def _raise_limit(chip: str, vmem_capacity: int | None) -> str:
    most = f" up to {_mib(vmem_capacity)}, {chip}'s whole VMEM" if vmem_capacity else ""
    return f"pass `vmem_limit_bytes` (in its TPU compiler_params){most}"


_REFUSAL_LINES = 8
"""Lines of a refusal kept: its first lines say what and where; the rest is MLIR context, or the
compiler's listing of allocations, summed up in one line (the largest three)."""
_NOT_THE_KERNELS_FAULT = re.compile(r"^\s*Please report a bug at\b.*$", re.M)
_PROTOCOL_BUFFER = re.compile(r"\[type\.googleapis\.com/[^\]]*\]?\]?", re.S)
_RUN_ON = re.compile(r"(exceeded scoped vmem limit by [\d.]+[KMG]?)\. It should not be\b.*$", re.M)
_ALLOCATION = re.compile(
    r"^\s*\d+\. Size: ([\d.]+[KMG]?)\s*$.*?^\s*Tag: (?:(input|output) window allocation for operator "
    r"(?:input|output) (\d+)\. The window shape is (\S+?)(?:, while|\.)|([^\n]*))",
    re.M | re.S,
)


def _refusal_text(error: BaseException) -> str:
    """The refusal's text without what is not about the kernel: the "report a bug" line (the kernel
    is at fault, not JAX), raw protocol buffers, a sentence cut off mid-way; a compiler's listing
    of allocations as its largest three, by operand and window."""
    text = f"{type(error).__name__}: {error}"
    text = _PROTOCOL_BUFFER.sub("", _NOT_THE_KERNELS_FAULT.sub("", text))
    text = _RUN_ON.sub(r"\1.", text)
    allocations = [
        f"{size} for {f'{kind} {index} (window {window})' if kind else other.strip() or 'an allocation'}"
        for size, kind, index, window, other in _ALLOCATION.findall(text)[:3]
    ]
    if allocations:
        listing = text.find("Largest program allocations")
        text = text[:listing].rstrip() + "\nLargest allocations: " + "; ".join(allocations) + "."
    lines = [line.rstrip() for line in text.splitlines() if line.strip() and set(line.strip()) != {"="}]
    if len(lines) > _REFUSAL_LINES:
        lines = [*lines[:_REFUSAL_LINES], f"... ({len(lines) - _REFUSAL_LINES} more lines)"]
    return "\n  ".join(lines)


_BLOCK_AND_ARRAY = re.compile(r"block shape \((.*?)\),? (?:while the overall )?array shape (?:is )?\(([\d, ]+)\)", re.S)
_SCOPED_VMEM = re.compile(r"size ([\d.]+[KMG]?) and limit ([\d.]+[KMG]?) exceeded scoped vmem limit")
_WHOLE_VMEM = re.compile(
    r"Used ([\d.]+[KMG]?) of ([\d.]+[KMG]?) vmem"
    r"|Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)[^\n]*space=vmem([^\n]*tag = 'scratch operand')?"
)
_WHOLE_SMEM = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)[^\n]*space=smem")
_TILING = re.compile(r"has tiling \((\d+, \d+)\), but its block shape")
_CAST = re.compile(r"Only (.+?) (?:is|are) supported, but got '(\w+)'")
_UNPROVEN = re.compile(r"cannot statically prove that index .*? is a multiple of (\d+)")
_SHRINK = (
    "shrink the blocks (each input and output block is double-buffered: halving a block's first dimension halves "
    "its share; `pipeline_mode=pl.Buffered(1)` on a BlockSpec whose block index never changes single-buffers it)"
)


class _Refused(NamedTuple):
    text: str
    chip: str
    vmem_capacity: int | None
    windows: Sequence[Any] = ()
    """The kernel's VMEM blocks (``operand``, ``shape``, ``bits``, ``bytes`` of one buffer)."""


def _legal_block(refused: _Refused) -> str | None:
    match = _BLOCK_AND_ARRAY.search(refused.text)
    if "divisible by 8 and 128" not in refused.text or match is None:
        return None
    block = [int(x) for x in re.findall(r"\d+", match.group(1))]
    array = [int(x) for x in re.findall(r"\d+", match.group(2))]
    if len(block) < 2 or len(block) != len(array):
        return None
    legal = list(block)
    for axis, unit in ((-2, 8), (-1, 128)):
        if block[axis] != array[axis]:
            legal[axis] = min(array[axis], max(unit, round(block[axis] / unit) * unit))
    shape = ", ".join(map(str, legal))
    return f"a block shape of ({shape}) (the last two dimensions multiples of 8 and 128, or equal to the array's)"


def _tiled_block(refused: _Refused) -> str | None:
    tiling = _TILING.search(refused.text)
    if tiling is None:
        return None
    return (
        f"a block shape whose last two dimensions are multiples of ({tiling.group(1)}), the tiling {refused.chip} "
        "uses for this dtype, or equal to the array's"
    )


def _scoped_vmem(refused: _Refused) -> str | None:
    scoped = _SCOPED_VMEM.search(refused.text)
    if scoped is None:
        return None
    needed, limit = _bytes(scoped.group(1)), _bytes(scoped.group(2))
    raise_limit = (
        f"the kernel needs {scoped.group(1)}iB of VMEM and {refused.chip} gives a kernel {scoped.group(2)}iB unless it "
        f"asks for more: {_raise_limit(refused.chip, refused.vmem_capacity)}"
    )
    if needed > (refused.vmem_capacity or needed):
        raise_limit = f"the kernel needs {scoped.group(1)}iB of VMEM, more than {refused.chip}'s whole VMEM"
    smaller = _smaller_blocks(refused.windows, needed, limit)
    return f"{raise_limit}; or {smaller}" if smaller else f"{raise_limit}, or {_SHRINK}"


def _smaller_blocks(windows: Sequence[Any], needed: int, limit: int) -> str | None:
    """The largest blocks that fit: each block's first dimension cut by the same share (keeping
    the tiling of a 2-D block), the rest of the kernel's VMEM as it is; and single buffering of
    one operand where that alone frees enough."""
    excess = needed - limit
    if excess <= 0 or not windows:
        return None
    buffered = 2 * sum(window.bytes for window in windows)  # at most: each block double-buffered
    fixed = max(0, needed - buffered)  # what is not blocks (the compiler's own scratch)
    share = (limit - fixed) / (needed - fixed)
    cuts: dict[tuple[str, str], list[str]] = {}
    for window in windows:
        shape = list(window.shape)
        if len(shape) < 2 or share <= 0:
            continue
        unit = 8 * max(32 // window.bits, 1) if len(shape) == 2 else 1  # a 2-D block's sublane tiling
        rows = int(shape[0] * share) // unit * unit
        if rows < unit or rows >= shape[0]:
            continue
        key = (", ".join(map(str, shape)), ", ".join(map(str, [rows, *shape[1:]])))
        cuts.setdefault(key, []).append(window.operand)
    ways = [f"({cut}) instead of ({now}) for {_listed(operands)}" for (now, cut), operands in cuts.items()]
    if ways:
        ways = ["blocks that fit: " + "; ".join(ways)]
    single = next((w for w in sorted(windows, key=lambda w: -w.bytes) if w.bytes >= excess), None)
    if single is not None:
        ways.append(
            f"`pipeline_mode=pl.Buffered(1)` on {single.operand}'s BlockSpec, if its block index never changes "
            f"(frees {_mib(single.bytes)}, enough)"
        )
    return "; or ".join(ways) or None


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _whole_vmem(refused: _Refused) -> str | None:
    whole = _WHOLE_VMEM.search(refused.text)
    if whole is None:
        return None
    used = whole.group(1) + "iB" if whole.group(1) else _mib(int(whole.group(3)))
    if whole.group(5):
        return (
            f"the kernel's VMEM scratch (its scratch_shapes) takes {used}, more than {refused.chip}'s whole VMEM: "
            "shrink it, or keep the part a grid step does not need in HBM (`memory_space=pl.ANY`)"
        )
    return f"the kernel needs {used} of VMEM, more than {refused.chip}'s whole VMEM: {_SHRINK}"


def _whole_smem(refused: _Refused) -> str | None:
    smem = _WHOLE_SMEM.search(refused.text)
    if smem is None:
        return None
    return (
        f"the kernel needs {_mib(int(smem.group(1)))} of SMEM, more than {refused.chip}'s {_mib(int(smem.group(2)))}: "
        "keep large tables in VMEM or in HBM (`memory_space=pl.ANY`) and copy in the part a grid step needs"
    )


def _cast(refused: _Refused) -> str | None:
    cast = _CAST.search(refused.text)
    if cast is not None:
        return (
            f"{refused.chip}'s compiler has {cast.group(1)} here, not {cast.group(2)}: cast the values to one of them "
            "in the kernel before the operation the message names (`x.astype(jnp.int32)`), and back after it"
        )
    if "Invalid vector type for load" in refused.text and "xf16>" in refused.text:
        return (
            f"{refused.chip} has no float16 vectors: keep the operands in bfloat16 or float32 (cast them outside "
            "the kernel), and compute in float32"
        )
    if "Bad lhs/rhs type" in refused.text:
        return (
            f"{refused.chip}'s matrix unit multiplies float32, bfloat16 and int8 operands (int8 accumulating in "
            "int32): cast the operands of this dot to one of them"
        )
    return None


def _aligned(refused: _Refused) -> str | None:
    unproven = _UNPROVEN.search(refused.text)
    if unproven is None:
        return None
    return (
        "say what the compiler cannot prove where the kernel computes the index: "
        f"`pl.multiple_of(index, {unproven.group(1)})` (or slice whole tiles of 8 x 128)"
    )


def _one_core(refused: _Refused) -> str | None:
    if "Core-parallel dimension" not in refused.text or "active cores" not in refused.text:
        return None
    return (
        f'{refused.chip} has one TensorCore: declare the axis "parallel" (split between cores where a chip has two) '
        'instead of "core_parallel"'
    )


_FIXES = (_legal_block, _tiled_block, _scoped_vmem, _whole_vmem, _whole_smem, _cast, _aligned, _one_core)
"""Each refusal whose fix can be named, and how: the first that recognises the text says it."""


def gpu_refusal_fix(text: str, gpu: Any, name: str) -> str | None:
    """A "To fix" for what XLA's GPU compiler refuses: blocks over a GPU's shared memory, a type its
    architecture lacks. ``gpu``: the target's figures (``gpu_compile.Gpu``)."""
    memory = re.search(r"requested (\d+), available: (\d+)|smem_bytes=(\d+) > max_smem_bytes=(\d+)", text)
    if memory is not None:
        used, limit = (int(n) for n in (memory.group(1, 2) if memory.group(1) else memory.group(3, 4)))
        return (
            f"the kernel's blocks need {size(used)} of shared memory and one block on an {name.upper()} can have "
            f"{size(gpu.shared_memory_per_block_optin)}: shrink its block shapes (or num_stages, which keeps that "
            f"many copies of each block) by {used / limit:.1f}x"
        )
    if re.search(r"f8|float8|fp8", text, re.IGNORECASE):
        return (
            f"an {name.upper()} (compute capability {gpu.compute_capability}.0) has no float8 arithmetic "
            "(it needs 8.9 or later: H100, L4): compute in bfloat16 there, or leave it out of the device setting"
        )
    arch = re.search(r"not supported on sm_(\d+)", text)
    if arch is not None:
        return (
            f"the kernel uses an instruction sm_{arch.group(1)} (an {name.upper()}) lacks: keep it to GPUs "
            "that have it, or leave this GPU out of the device setting"
        )
    return None


def refusal_fix(
    error: BaseException,
    *,
    target: str | None = None,
    vmem_capacity: int | None = None,
    windows: Sequence[Any] = (),
) -> str | None:
    """A "To fix" line for the refusals whose fix can be named (``_FIXES``): a TPU block shape not
    divisible by its tiling, scoped or whole VMEM or SMEM exhausted (the limit to raise, up to
    ``vmem_capacity``, the physical VMEM of ``target``'s TensorCore; the largest blocks that fit and
    the operand to single-buffer, where the kernel's ``windows`` are known; or the blocks to shrink), a
    type the generation cannot load or compute in, an index the compiler cannot prove aligned, a
    core-parallel axis on a one-core chip."""
    refused = _Refused(str(error), target or "this TPU", vmem_capacity, windows)
    fix = next((fix for fix in (rule(refused) for rule in _FIXES) if fix), None)
    line = kernel_line(error)
    return f"{fix} (the compiler points at {printable(line)})" if fix and line else fix


def kernel_line(error: BaseException) -> str | None:
    """``file:line`` in the kernel that a refusal's traceback names (Pallas's ``MosaicError``
    carries the kernel's frames, read from the MLIR locations), else None."""
    import traceback

    try:
        frames = traceback.extract_tb(error.__traceback__)
    except Exception:  # a traceback that cannot be read: no line
        return None
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        if frame.lineno and not any(part in path for part in ("/jax/", "/jaxlib/", "/pallas_guard/", "<")):
            return f"{frame.filename}:{frame.lineno}"
    return None


def refused_memory(error: BaseException) -> list[tuple[str, int, int]]:
    """``(space, used, limit)`` in bytes for each memory a TPU refusal says was exhausted: scoped
    VMEM (``"VMEM"``), a scratch placed in the whole VMEM (``"VMEM scratch"``), the whole VMEM, SMEM."""
    text = str(error)
    figures = []
    scoped = _SCOPED_VMEM.search(text)
    if scoped is not None:
        figures.append(("VMEM", _bytes(scoped.group(1)), _bytes(scoped.group(2))))
    whole = _WHOLE_VMEM.search(text)
    if whole is not None and whole.group(1):
        figures.append(("VMEM", _bytes(whole.group(1)), _bytes(whole.group(2))))
    elif whole is not None:
        figures.append(("VMEM scratch" if whole.group(5) else "VMEM", int(whole.group(3)), int(whole.group(4))))
    smem = _WHOLE_SMEM.search(text)
    if smem is not None:
        figures.append(("SMEM", int(smem.group(1)), int(smem.group(2))))
    return figures


def _bytes(figure: str) -> int:
    """libtpu's ``16.00M`` (binary units) in bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(figure[-1:], 1)
    return round(float(figure.rstrip("KMG")) * scale)


def _mib(count: int | None) -> str:
    return f"{(count or 0) / (1 << 20):.2f}MiB"


def not_armed(failure: str) -> str:
    """The one message of a guard that could not arm: which part failed, on which jax, what to do."""

    policy = current("policy")
    jax, jaxlib = jax_lookup.jax_version(), jax_lookup.jax_version("jaxlib")
    return printable(
        f"pallas_guard could not arm on jax {jax} (jaxlib {jaxlib}): "
        f"{failure}. "
        f"Pallas kernels in this process are not interpreted: each one that lowers for the CPU without "
        f"interpret= is refused with this message (policy {policy.value.value} from {policy.source}). "
        f"To fix: upgrade pallas_guard (pip install -U pallas_guard) or install a jax it supports "
        f"({jax_lookup.SUPPORTED}); to run without the guard, {how_to_set('policy', Policy.OFF, policy.source)}."
    )


def finding_in(error: BaseException) -> PallasGuardError | None:
    """The plain interpreter's bounds or race finding ``error`` carries, as the guard's own error:
    raised from a host callback, it reaches the caller inside JAX's runtime error (its line kept)."""
    for line in str(error).splitlines():
        start = min((i for i in (line.find(FINDING), line.find(RACE_FINDING)) if i >= 0), default=-1)
        if start >= 0:
            return PallasGuardError(line[start:].strip())
    return None


def bounds_error(error: BaseException, *, kernel: KernelInfo, call_site: CallSite) -> PallasGuardError | None:
    """A bounds finding ``error`` carries: the plain interpreter's, or TPU interpret mode's ("Out-of-bounds
    read"), as the guard's own error; None if it carries none."""
    found = finding_in(error)
    if found is not None:
        return found
    finding = next((line.strip() for line in str(error).splitlines() if "Out-of-bounds read" in line), None)
    return None if finding is None else bounds_finding(finding, kernel=kernel, call_site=call_site, what="read")


# One registry per file, as Python keeps one per module: with it the "default" action shows a
# warning once per location; "error"/"always" see every one, and a filter change (pytest does one
# per test) resets it. The guard keeps no once-only memory of its own.
_registries: dict[str, dict[Any, Any]] = {}


def warn(*, kernel: KernelInfo, call_site: CallSite, target: Target, policy: Setting[Policy], interpreter: str) -> bool:
    """Emit a ``PallasGuardWarning`` attributed to the user's line; repetition is the filters' business."""
    __tracebackhide__ = True
    text = message(
        refused=False,
        kernel=kernel,
        call_site=call_site,
        target=target,
        policy=policy,
        interpreter=interpreter,
    )
    _warn_at(call_site, text)
    return True


def _warn_at(call_site: CallSite, text: str) -> None:
    __tracebackhide__ = True  # a warning turned error is the user's line's, not this frame's
    filename, _, line = (call_site.user or "").rpartition(":")
    if filename and line.isdigit():
        # warn_explicit puts the warning on the user's line even from inside a lowering rule,
        # where no stacklevel could reach it; the formatter prints the name as given: escaped.
        registry = _registries.setdefault(filename, {})
        warnings.warn_explicit(text, PallasGuardWarning, printable(filename), int(line), registry=registry)
    else:
        warnings.warn(text, PallasGuardWarning, stacklevel=3)


# --- what a report shows ------------------------------------------------------------------------

_JAX_FILTERED_NOTE = "For simplicity, JAX has removed its internal frames"


def as_reported(error: BaseException) -> BaseException:
    """What a test report shows for ``error``: the guard's own error or warning, once.

    JAX repeats an error raised while lowering (a ``JaxStackTraceBeforeTransformation`` cause, a
    note about its filtered frames), and a bounds finding raised in a host callback reaches the
    caller inside JAX's runtime error, with the callback's whole stack in its text: the guard's
    message says it all, at the user's line. Any other error is returned as it is.
    """
    guard = error if isinstance(error, (PallasGuardError, PallasGuardWarning)) else finding_in(error)
    if guard is None:
        return error
    head = str(guard).strip().partition("\n")[0]
    cause = guard.__cause__
    if cause is not None and (type(cause).__name__ == "JaxStackTraceBeforeTransformation" or head in str(cause)):
        guard.__cause__ = None
        guard.__suppress_context__ = True
    notes = getattr(guard, "__notes__", None)
    if notes:
        notes[:] = [note for note in notes if _JAX_FILTERED_NOTE not in note]
    return guard.with_traceback(_without_guard_frames(error.__traceback__))


def _without_guard_frames(traceback: types.TracebackType | None) -> types.TracebackType | None:
    """``traceback`` without the guard's own frames (and wrapt's, its machinery): they say nothing
    about the user's kernel, and not every one of them can hide itself (``__tracebackhide__``)."""
    kept = []
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename
        if not filename.startswith(_guard_prefixes()):
            kept.append(traceback)
        traceback = traceback.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


@functools.lru_cache(maxsize=1)
def _guard_prefixes() -> tuple[str, ...]:
    wrapt_file = getattr(sys.modules.get("wrapt"), "__file__", None)
    wrapt_dir = [os.path.dirname(os.path.abspath(wrapt_file)) + os.sep] if wrapt_file else []
    return (jax_source.PACKAGE_DIR + os.sep, *wrapt_dir)
