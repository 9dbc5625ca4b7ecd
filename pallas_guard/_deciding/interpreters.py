"""JAX's interpreters: which one runs a kernel, what each gets wrong, and failures none can pass.

Measured on JAX's own shipped kernels: the plain interpreter (``interpret=True``) runs every Triton
kernel and the single-device Mosaic-TPU kernels (manual DMAs, DMA semaphores, scalar prefetch)
correctly and 10-400x faster than TPU interpret mode; TPU interpret mode is needed only for
cross-device semantics (remote DMAs, device ids, barrier semaphores), and there only with eager DMA
execution; Mosaic-GPU kernels run only in the Mosaic-GPU interpreter. So: plain unless the kernel's
facts (``facts``) say otherwise.
"""

from __future__ import annotations

import linecache
from typing import NamedTuple

from pallas_guard._deciding.facts import GENERIC, KernelFacts
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._vocabulary.enums import Interpreter
from pallas_guard._vocabulary.settings import Setting
from pallas_guard_autoload import CHECKS_ENV


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
