"""pallas_guard at interpreter start-up: the settings table, and the autoload.

PYTEST_DONT_REWRITE: pytest marks every top-level module of a distribution with a ``pytest11``
entry point for assertion rewriting and warns about each one already imported; this one is
imported at start-up by design and has no asserts to rewrite.

Imports nothing but ``os``, ``sys`` and the builtin ``_thread``: every Python process of an
environment with the autoload pays for this module when a ``PALLAS_GUARD_*`` variable is set. It
holds what start-up needs and nothing else:

- :data:`OPTIONS`, the one declaration of every setting (variable, parser, accepted values,
  default); the package builds its sources and scopes on it, the pytest plugin and the CLI read it.
- :func:`activate`, called by the ``.pth`` line (Python < 3.15), by the PEP 829 ``.start`` entry
  point (Python >= 3.15, where ``.pth`` import lines stop running) and by a ``sitecustomize``. When
  the guard is wanted and every variable is valid, it registers a post-import hook that imports
  ``pallas_guard`` (which installs the guard) when ``jax.pallas`` or ``jax.experimental.pallas`` is imported. A bad
  value prints one line and still installs the guard, whose first kernel raises the error (never a
  silently unguarded process); an explicit ``import pallas_guard`` raises it at once.
"""

import _thread  # threading's lock and local, loaded before site runs; `import threading` costs more
import os
import sys

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: typing costs start-up time
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]

POLICY_ENV = "PALLAS_GUARD_POLICY"
"""Activates the guard (with the autoload) and sets its policy."""
INTERPRETER_ENV = "PALLAS_GUARD_INTERPRETER"
"""Forces one interpreter instead of the per-kernel choice."""
CHECKS_ENV = "PALLAS_GUARD_CHECKS"
"""Checks on interpreted kernels: ``races``, ``bounds``, ``agree``, ``lowering``, ``all`` or ``none``."""
DETECT_RACES_ENV = "PALLAS_GUARD_DETECT_RACES"
"""``1``: the older spelling of ``PALLAS_GUARD_CHECKS=races``."""
MAX_STEPS_ENV = "PALLAS_GUARD_MAX_STEPS"
"""The most grid steps an interpreted kernel may run."""
VMEM_HEADROOM_ENV = "PALLAS_GUARD_VMEM_HEADROOM"
"""The share of a TPU generation's VMEM limit a kernel the compile check compiles must leave free."""
EXIT_SUMMARY_ENV = "PALLAS_GUARD_EXIT_SUMMARY"
"""Set by ``pallas-guard run``: each guarded process prints its TPU memory figures to stderr at exit."""
FAST_PLAIN_ENV = "PALLAS_GUARD_FAST_PLAIN"
"""``off``: the plain interpreter exactly as JAX ships it (the way back from the guard's fast path)."""
DEVICE_ENV = "PALLAS_GUARD_DEVICE"
"""The TPU/GPU that host code asking "which accelerator am I on?" is told, where the guard interprets."""
REQUIRE_CHECKS_ENV = "PALLAS_GUARD_REQUIRE_CHECKS"
"""``1``: a check asked for that cannot run on a kernel fails that kernel's call instead of noting it (for CI)."""
PALLAS_INTERPRET_ENV = "PALLAS_INTERPRET"
"""Read by other Pallas projects: truthy means policy ``interpret`` when ``PALLAS_GUARD_POLICY`` is unset."""
PALLAS_MODULES = ("jax.pallas", "jax.experimental.pallas")
"""Pallas's public faces: ``jax.pallas`` (jax >= 0.12.1, the preferred import) and ``jax.experimental.pallas``;
importing either loads the guard."""


class PallasGuardConfigError(ValueError):
    """A setting (environment variable or API argument) has a value pallas_guard does not accept."""


# One class per process, whatever reloads this module: `pallas_guard` catches and re-exports the
# first one, so a second class would escape its handlers.
_ERROR_CLASS = "_pallas_guard_config_error"  # on sys: outlives a reload, as say_once's lines do
PallasGuardConfigError = getattr(sys, _ERROR_CLASS, PallasGuardConfigError)  # type: ignore[misc]
setattr(sys, _ERROR_CLASS, PallasGuardConfigError)
PallasGuardConfigError.__module__ = "pallas_guard"  # the name users import and catch


def shown(value: object) -> str:
    """A value as messages print it: ``ascii()``, so a look-alike (a Cyrillic letter in 'warn')
    prints escaped, visibly not 'warn', and a control character cannot forge a line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"  # repr() itself refuses past 4300 digits
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:40]!a}... ({len(value)} characters)"
    try:
        return ascii(value)
    except ValueError:
        return f"a {type(value).__name__} that cannot be printed"


def printable(text: str) -> str:
    """``text`` with every control or other unprintable character escaped (``\\x1b``, ``\\n``): a
    kernel's name or a variable's value must not move the cursor or forge a line of a report."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def closest(word: str, vocabulary: "Sequence[str]") -> str | None:
    """The accepted word nearest to ``word`` (a typo's likely intent), else None."""
    import difflib  # only on the error path: start-up imports nothing but os and sys

    matches = difflib.get_close_matches(word, vocabulary, n=1, cutoff=0.6)
    return matches[0] if matches else None


class Option:
    """One setting: its variable, pytest option and ini key, how a value is parsed, what is
    accepted (with each word's meaning), its default and its help."""

    __slots__ = (
        "accepted",
        "alias",
        "also",
        "default",
        "env",
        "help",
        "ini",
        "kind",
        "meanings",
        "name",
        "parse_word",
        "pytest_option",
        "vocabulary",
        "word_of",
    )

    def __init__(  # noqa: PLR0917 - one row of the OPTIONS table, read positionally
        self,
        name: str,
        env: str,
        kind: str,
        parse_word: "Callable[[str], Any]",
        accepted: str,
        default: object,
        help: str,
        word_of: "Callable[[object], str | None]" = lambda value: None,
        alias: "Option | None" = None,
        also: str = "",
        meanings: "Mapping[str, str] | None" = None,
        vocabulary: "Sequence[str]" = (),
    ) -> None:
        self.name = name
        self.env = env
        self.pytest_option = "--pallas-guard-" + name.replace("_", "-")
        self.ini = "pallas_guard_" + name
        self.kind = kind
        self.parse_word = parse_word  # normalised str -> value, or None when not accepted
        self.accepted = accepted
        self.default = default
        self.help = help
        self.word_of = word_of  # a non-str API value (an int, a list) -> its word, or None: wrong type
        self.alias = alias  # another variable that sets this option when this one is unset
        self.also = also  # the types word_of accepts, for the error: " or int"
        self.meanings = dict(meanings or {})  # each accepted word -> what it does, in one line
        self.vocabulary = tuple(vocabulary) or tuple(self.meanings)  # the words a typo is matched against

    def parse(self, value: object, source: str) -> "Any":
        """``value`` (a str, or a value of an accepted type) parsed, or an error naming ``source``."""
        word = value if isinstance(value, str) else self.word_of(value)
        if word is None:
            raise TypeError(
                f"{source} must be a str{self.also}, got {type(value).__name__} {shown(value)}; "
                f"accepted values: {self.accepted}"
            )
        normalised = word.strip().lower()
        parsed = self.parse_word(normalised)
        if parsed is None:
            raise PallasGuardConfigError(
                f"{source}={shown(value)} is not a valid pallas_guard {self.kind}; "
                f"accepted values (case-insensitive): {self.accepted}{self.suggestion(normalised)}"
            )
        return parsed

    def suggestion(self, word: str) -> str:
        """``; did you mean 'interpret'?`` for a near miss of an accepted word (each part of a
        comma list on its own), else nothing."""
        if not self.vocabulary or not word:
            return ""
        if "," in word and self.kind in ("set of checks", "device"):
            parts = [part.strip() for part in word.split(",") if part.strip()]
            fixed = [part if part in self.vocabulary else closest(part, self.vocabulary) for part in parts]
            fix = ",".join(fixed) if parts and None not in fixed else None  # type: ignore[arg-type]
            return f"; did you mean {fix!r}?" if fix is not None and fix != ",".join(parts) else ""
        near = closest(word, self.vocabulary)
        return f"; did you mean {near!r}?" if near is not None else ""

    def word(self, value: object) -> str:
        """A value as the word that sets it: ``warn``, ``races,bounds``, ``none``, ``64``."""
        if value is None:
            return "none"
        if isinstance(value, (set, frozenset)):
            return ",".join(check for check in CHECKS if check in value) or "none"
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(getattr(value, "value", value))

    def variables(self) -> "tuple[str, ...]":
        """The variables that set this option: its own, then its alias."""
        return (self.env, self.alias.env) if self.alias is not None else (self.env,)

    def setting_from_environment(self, environ: "Mapping[str, str] | None" = None) -> "tuple[Any, str] | None":
        """``(value, variable)`` from this option's variable, else from its alias; None when neither
        is set (or the alias says "nothing"); raises on a bad value, naming the variable."""
        raw = (os.environ if environ is None else environ).get(self.env)
        if raw is not None and raw.strip():
            return self.parse(raw, self.env), self.env
        if self.alias is not None:
            found = self.alias.setting_from_environment(environ)
            if found is not None and found[0] is not _NOTHING:
                return found
        return None

    def from_environment(self, environ: "Mapping[str, str] | None" = None) -> "Any":
        """The value the environment sets, or None when it sets none; raises on a bad value."""
        found = self.setting_from_environment(environ)
        return None if found is None else found[0]


_NOTHING = object()
"""What an alias's falsy value means: the option is not set (``PALLAS_INTERPRET=0``)."""


def _choice(*words: str) -> "Callable[[str], str | None]":
    accepted = frozenset(words)
    return lambda word: word if word in accepted else None


_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})
_BOOLEAN_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


_MAX_INT_DIGITS = 18  # past any grid a test runs; and int() itself refuses past 4300


def positive_int(word: str) -> int | None:
    """The one parser of integer settings: ASCII digits only (``int()`` would take a fullwidth ``'1'``, ``'1_0'``
    and ``'+1'``, and refuse ``'²'``, which ``str.isdigit()`` accepts), at most 18 of them; else None."""
    if not (0 < len(word) <= _MAX_INT_DIGITS and word.isascii() and word.isdigit()):
        return None
    number = int(word)
    return number if number > 0 else None


def _word_of_int(value: object) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    # A huge int: a word parse refuses by its length, without str() (which raises past 4300 digits).
    return str(value) if value.bit_length() <= 64 else "9" * (_MAX_INT_DIGITS + 1)


def fraction(word: str) -> float | None:
    """A share below one: ``0.05`` or ``5%`` (ASCII digits and one point, at most 18 characters);
    ``0`` for none; else None."""
    number = word[:-1].strip() if word.endswith("%") else word
    if not (0 < len(number) <= _MAX_INT_DIGITS and number.isascii() and number.replace(".", "", 1).isdigit()):
        return None
    value = float(number) / (100 if word.endswith("%") else 1)
    return value if 0 <= value < 1 else None


def _word_of_fraction(value: object) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return repr(float(value))


CHECKS = {
    # name: the module that holds its ``CHECK`` (imported when the check is first in force)
    "races": "pallas_guard._checks.races",
    "bounds": "pallas_guard._checks.bounds",
    "agree": "pallas_guard._checks.agree",
    "lowering": "pallas_guard._checks.lowering",
    "compile": "pallas_guard._checks.compile",
}
"""The checks, in the order settings are shown: a check is its module and its line here."""
BY_NAME_ONLY = {
    "agree": "it runs each kernel's first call again in a second interpreter, JAX's TPU interpret mode for a "
    "Mosaic-TPU kernel, which costs 2-6x an unchecked first call there",
}
"""The checks ``all`` leaves out, and why: ``all`` is what a CI job leaves on (no false finding, a
cost once per kernel, the compile check's kept on disk for later runs); these are asked for by name
(``all,agree``)."""
ALL_CHECKS = frozenset(CHECKS) - frozenset(BY_NAME_ONLY)
"""What ``all`` means."""


def _checks(word: str) -> "frozenset[str] | None":
    if word == "none":
        return frozenset()
    parts = {part.strip() for part in word.split(",") if part.strip()}
    if "all" in parts:
        parts = (parts - {"all"}) | ALL_CHECKS
    return frozenset(parts) if parts and parts <= set(CHECKS) else None


def _boolean(word: str) -> "bool | None":
    return True if word in _TRUE else False if word in _FALSE else None


def _word_of_bool(value: object) -> str | None:
    return ("on" if value else "off") if isinstance(value, bool) else None


def _word_of_checks(value: object) -> str | None:
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(part, str) for part in value):
        return ",".join(value) if value else "none"
    return None


POLICIES = {
    "interpret": "run interpreted, silently",
    "warn": "run interpreted, with a PallasGuardWarning at the caller's line",
    "strict": "be refused with a PallasGuardError that says why and how to fix it",
    "off": "fail with JAX's own error, as without the guard",
}
"""Each policy and what it does to a Pallas kernel that would lower for the CPU without interpret=."""

DEVICES = {
    # short name: (JAX's device kind, cores, platform). TPU cores are TensorCores per chip; a GPU's
    # are its SMs, 8 as in JAX's own interpret tests: the Mosaic-GPU interpreter simulates each one.
    "tpu-v4": ("TPU v4", 2, "tpu"),
    "tpu-v5e": ("TPU v5 lite", 1, "tpu"),
    "tpu-v5p": ("TPU v5p", 2, "tpu"),
    "tpu-v6e": ("TPU v6 lite", 1, "tpu"),
    "tpu7x": ("TPU7x", 2, "tpu"),
    "a100": ("NVIDIA A100-SXM4-80GB", 8, "gpu"),
    "h100": ("NVIDIA H100 80GB HBM3", 8, "gpu"),
    "h200": ("NVIDIA H200", 8, "gpu"),
    "b200": ("NVIDIA B200", 8, "gpu"),
}
"""The devices ``PALLAS_GUARD_DEVICE`` accepts: a short name, or JAX's own device kind for it."""
_DEVICE_WORDS = {**{name: name for name in DEVICES}, **{kind.lower(): name for name, (kind, _, _) in DEVICES.items()}}
_DEVICE_WORDS.update({"tpu v5e": "tpu-v5e", "tpu v5": "tpu-v5p", "tpu v6e": "tpu-v6e", "tpu-v7x": "tpu7x"})


TPU_SLICE_DIMS = {"tpu-v4": 3, "tpu-v5e": 2, "tpu-v5p": 3, "tpu-v6e": 2, "tpu7x": 3}
"""How many dimensions a slice of each TPU generation has (``v5e:2x4``, ``v5p:2x2x2``)."""
TPU_DEVICES_PER_CHIP = {"tpu7x": 2}
"""JAX presents each of a tpu7x chip's two TensorCores as a device (measured: ``tpu7x:2x2x1`` has 8)."""


def slice_devices(generation: str, shape: "tuple[int, ...]") -> int:
    """How many devices JAX sees on a slice of ``generation`` of ``shape`` chips."""
    devices = TPU_DEVICES_PER_CHIP.get(generation, 1)
    for side in shape:
        devices *= side
    return devices


_MAX_SLICE_SIDE = 64


def _device(word: str) -> "str | None":
    """One device, or a comma-separated list of them (one per family, or TPU generations to compile
    for), as the canonical names joined by commas; None where a part is unknown. A TPU may name the
    slice a sharded program runs on: ``tpu-v5e:2x4``."""
    if word == "none":
        return _NONE
    names = [_device_part(part.strip()) for part in word.split(",") if part.strip()]
    if not names or None in names:
        return None
    return ",".join(dict.fromkeys(names))  # type: ignore[arg-type]


def _device_part(part: str) -> "str | None":
    name, colon, shape = part.partition(":")
    device = _DEVICE_WORDS.get(name.strip())
    if not colon or device is None:
        return device
    sides = shape.strip().split("x")
    if len(sides) != TPU_SLICE_DIMS.get(device, 0):
        return None
    if not all(side.isascii() and side.isdigit() and 0 < int(side) <= _MAX_SLICE_SIDE for side in sides):
        return None
    return f"{device}:{'x'.join(str(int(side)) for side in sides)}"


def device_list(value: object) -> "tuple[str, ...]":
    """The device setting's value as its devices, in the order given (none: empty)."""
    if not isinstance(value, str) or value == _NONE:
        return ()
    names = (part.partition(":")[0] for part in value.split(","))
    return tuple(name for name in names if name in DEVICES)


def device_slice(value: object, generation: str) -> "tuple[int, ...] | None":
    """The slice the device setting names for TPU ``generation`` (``tpu-v5e:2x4``: (2, 4)), or None."""
    if not isinstance(value, str):
        return None
    for part in value.split(","):
        name, colon, shape = part.partition(":")
        if colon and name == generation:
            return tuple(int(side) for side in shape.split("x"))
    return None


def _word_of_devices(value: object) -> str | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(part, str) for part in value):
        return ",".join(value)
    return None


_NONE = "none"
"""The device setting's "no device" (a str: None means "not accepted" to the parsers)."""

OPTIONS = {
    option.name: option
    for option in (
        Option(
            "policy",
            POLICY_ENV,
            "policy",
            _choice(*POLICIES),
            ", ".join(map(repr, POLICIES)),
            "warn",
            "what happens to a Pallas kernel that would lower for the CPU without interpret=: "
            + "; ".join(f"{word} ({meaning})" for word, meaning in POLICIES.items()),
            meanings=POLICIES,
            alias=Option(
                "policy",
                PALLAS_INTERPRET_ENV,
                "PALLAS_INTERPRET value",
                lambda word: "interpret" if word in _TRUE else _NOTHING if word in _FALSE else None,
                ", ".join(sorted(_TRUE)) + " (policy interpret) / " + ", ".join(sorted(_FALSE)) + ", or empty",
                None,
                "the variable other Pallas projects read; truthy means policy interpret",
                vocabulary=_BOOLEAN_WORDS,
            ),
        ),
        Option(
            "interpreter",
            INTERPRETER_ENV,
            "interpreter",
            _choice("auto", "plain", "tpu", "gpu"),
            "'auto', 'plain', 'tpu', 'gpu'",
            "auto",
            "which interpreter runs those kernels: auto (chosen per kernel), plain, tpu or gpu",
            meanings={
                "auto": "chosen per kernel: plain unless it needs TPU or Mosaic-GPU semantics, or a check",
                "plain": "JAX's HLO interpreter (interpret=True)",
                "tpu": "TPU interpret mode",
                "gpu": "the Mosaic-GPU interpreter",
            },
        ),
        Option(
            "checks",
            CHECKS_ENV,
            "set of checks",
            _checks,
            "'races', 'bounds', 'agree', 'lowering', 'compile' (comma-separated), 'all' (every check but agree; "
            "'all,agree' adds it) or 'none'",
            frozenset(),
            "check interpreted kernels: races (DMA and semaphore races, waits no signal satisfies, output blocks "
            "written across a parallel grid axis; checked inside the plain interpretation or by TPU interpret "
            "mode's detector where a kernel runs there), bounds (an out-of-bounds index raises; "
            "in every interpreter), agree (the first call runs "
            "in every interpreter that can run the kernel, and their outputs must agree where the kernel wrote), "
            "lowering (the first call also lowers the kernel for its real target, TPU or GPU, as JAX does "
            "there), compile (a Mosaic-TPU kernel is also compiled by the TPU's own compiler, libtpu, for the "
            "device's generation); all: every check but those asked for by name, agree (" + BY_NAME_ONLY["agree"] + ")",
            word_of=_word_of_checks,
            also=" or a list of str",
            vocabulary=(*CHECKS, "all", "none"),
            alias=Option(
                "checks",
                DETECT_RACES_ENV,
                "boolean",
                lambda word: frozenset({"races"}) if word in _TRUE else _NOTHING if word in _FALSE else None,
                ", ".join(sorted(_TRUE)) + " / " + ", ".join(sorted(_FALSE)) + ", or empty",
                None,
                f"the older spelling of {CHECKS_ENV}=races",
                vocabulary=_BOOLEAN_WORDS,
            ),
        ),
        Option(
            "require_checks",
            REQUIRE_CHECKS_ENV,
            "boolean",
            _boolean,
            ", ".join(sorted(_TRUE)) + " / " + ", ".join(sorted(_FALSE)),
            False,
            "a check asked for that cannot run on a kernel (libtpu missing or not the version this jax pins, a "
            "context the check does not cover) fails that kernel's call with a PallasGuardError naming the check, "
            "the kernel and why, instead of a note on its decision; recommended for CI",
            word_of=_word_of_bool,
            also=" or bool",
            meanings={
                "on": "a check that cannot run on a kernel fails its call",
                "off": "a check that cannot run on a kernel is a note on its decision",
            },
            vocabulary=_BOOLEAN_WORDS,
        ),
        Option(
            "fast_plain",
            FAST_PLAIN_ENV,
            "boolean",
            _boolean,
            ", ".join(sorted(_TRUE)) + " / " + ", ".join(sorted(_FALSE)),
            True,
            "the plain interpreter without writing back, at each grid step, the blocks of operands the kernel "
            "never writes (bit-identical, linear in the data); off: JAX's plain interpreter exactly as it ships",
            word_of=_word_of_bool,
            also=" or bool",
            meanings={
                "on": "blocks the kernel never writes are not copied back at each grid step",
                "off": "JAX's plain interpreter exactly as it ships",
            },
            vocabulary=_BOOLEAN_WORDS,
        ),
        Option(
            "device",
            DEVICE_ENV,
            "device",
            _device,
            "'none', " + ", ".join(map(repr, DEVICES)) + ", or JAX's device kind for one of them ('TPU v5 lite', "
            "'NVIDIA H100 80GB HBM3', ...); or several, comma-separated; a TPU may name its slice, sides of 1 to "
            f"{_MAX_SLICE_SIDE} chips: 'tpu-v5e:2x4' (two sides for v5e and v6e, three for v4, v5p and tpu7x)",
            _NONE,
            "the TPU/GPU that host code asking which accelerator it runs on is told (JAX's abstract device), "
            "where the target is the CPU and the guard interprets; several (comma-separated): host code is told "
            "the first, each kernel family is lowered for the first of its own platform, and the compile check "
            "compiles for every TPU generation listed (a kernel inside shard_map: for the slice named, else for "
            "one with as many chips as the mesh has devices)",
            word_of=_word_of_devices,
            also=" or a list of str",
            meanings={
                "none": "host code sees the CPU it runs on",
                **{name: f"host code sees a {kind} ({cores} cores)" for name, (kind, cores, _) in DEVICES.items()},
            },
            vocabulary=("none", *DEVICES),
        ),
        Option(
            "max_steps",
            MAX_STEPS_ENV,
            "step budget",
            positive_int,
            f"a positive integer of at most {_MAX_INT_DIGITS} ASCII digits (grid steps), or unset for no budget",
            None,
            "the most grid steps an interpreted kernel may run; a kernel over it is not run",
            word_of=_word_of_int,
            also=" or int",
        ),
        Option(
            "vmem_headroom",
            VMEM_HEADROOM_ENV,
            "share",
            fraction,
            "a share of a memory below 1, as a fraction ('0.05') or a percentage ('5%'); '0' for none",
            0.0,
            "the compile check's margin: a TPU kernel that compiles but takes more than (1 - headroom) of a "
            "generation's VMEM limit (scoped, or whole for a scratch placed outside it) is a finding, as it would "
            "be refused after a small change of shapes or of the compiler",
            word_of=_word_of_fraction,
            also=" or float",
        ),
    )
}
"""Every setting, declared once: ``install()``, ``policy()``, the pytest plugin and the CLI use it."""


def read_environment(environ: "Mapping[str, str] | None" = None) -> "dict[str, tuple[Any, str]]":
    """``{option name: (value, variable)}`` for every option the environment sets; raises on the
    first bad value."""
    found: dict[str, tuple[Any, str]] = {}
    for name, option in OPTIONS.items():
        setting = option.setting_from_environment(environ)
        if setting is not None:
            found[name] = setting
    return found


_PREFIXES = ("PALLAS_GUARD_", "PALLAS_INTERPRET")


def unknown_variables(environ: "Mapping[str, str] | None" = None) -> "list[str]":
    """One sentence per ``PALLAS_GUARD_*``/``PALLAS_INTERPRET*`` variable set here that pallas_guard
    does not read (a misspelling reads as "nothing set": the guard off, a check never run), naming the
    closest variable it does read."""
    environ = os.environ if environ is None else environ
    found = [name for name in environ if name.startswith(_PREFIXES)]  # cheap: no match, no more work
    if not found:
        return []
    known = [variable for option in OPTIONS.values() for variable in option.variables()]
    set_by_the_cli = {EXIT_SUMMARY_ENV}
    sentences = []
    for name in sorted(set(found) - set(known) - set_by_the_cli):
        near = closest(name, known)
        hint = f"; did you mean {near}?" if near else f"; the variables it reads: {', '.join(known)}"
        sentences.append(f"{name} is not a pallas_guard variable and is ignored{hint}")
    return sentences


def say_once(key: str, lines: "Sequence[str]") -> None:
    """Write ``lines`` to stderr unless this process wrote the same ones under ``key`` last: kept on
    ``sys``, so a reload of this module or of the package, and site running a venv's ``.pth`` files
    twice (CPython 3.11, 3.12), print them once. A line, never a Python warning, which ``-W error``
    would turn into a crash of a run the guard may have no business in."""
    if lines and getattr(sys, key, None) != list(lines):
        setattr(sys, key, list(lines))
        for line in lines:
            sys.stderr.write(line + "\n")


def report_unknown_variables() -> None:
    """One line per variable the guard does not read, once per process."""
    sentences = unknown_variables()
    say_once("_pallas_guard_unknown_variables", [f"pallas_guard: warning: {sentence}" for sentence in sentences])


def guard_wanted(environ: "Mapping[str, str] | None" = None) -> bool:
    """Whether the environment asks for the guard in every process: the policy variable is set, or
    ``PALLAS_INTERPRET`` is (any value but a falsy one; a bad one is reported at start-up)."""
    environ = os.environ if environ is None else environ
    interpret = environ.get(PALLAS_INTERPRET_ENV, "").strip().lower()
    return bool(environ.get(POLICY_ENV, "").strip()) or bool(interpret and interpret not in _FALSE)


# --- the post-import hook ----------------------------------------------------------------------
# Ours, not wrapt's: `import wrapt` costs ~100 ms (asyncio, importlib.metadata).


_hook_depth: "dict[int, int]" = {}
"""Thread id -> how many post-import callbacks of ours run inside an import in that thread."""


def in_import_hook() -> bool:
    """True while a post-import callback runs inside the import of a watched module: an exception
    raised there would leave JAX's modules half-imported (a second import of ``pallas_call`` then
    fails, "Config option ... already defined", seen on jax 0.9.2), so nothing may raise there."""
    return _hook_depth.get(_thread.get_ident(), 0) > 0


class _CallbackLoader:
    """Delegates to the real loader, then runs the callbacks once the module has executed."""

    def __init__(self, loader: "Any", name: str, finder: "PostImportFinder") -> None:
        self._loader = loader
        self._name = name
        self._finder = finder

    def create_module(self, spec: "Any") -> "ModuleType | None":
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "ModuleType") -> None:
        # Put the real loader back, so the module looks as if no hook had been there.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        thread = _thread.get_ident()
        _hook_depth[thread] = _hook_depth.get(thread, 0) + 1
        try:
            self._finder.fire(self._name, module)
        finally:
            _hook_depth[thread] -= 1

    def __getattr__(self, name: str) -> "Any":
        return getattr(self._loader, name)


class PostImportFinder:
    """A ``sys.meta_path`` entry that only wraps the loader of the modules it watches."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callback]] = {}
        self._lock = _thread.allocate_lock()

    def register(self, name: str, callback: "Callback") -> None:
        """Run ``callback(module)`` after ``name`` is imported; at once if it already is."""
        with self._lock:
            callbacks = self._callbacks.setdefault(name, [])
            if callback not in callbacks:
                callbacks.append(callback)
        module = sys.modules.get(name)
        if module is not None:
            callback(module)

    def fire(self, name: str, module: "ModuleType") -> None:
        with self._lock:
            callbacks = list(self._callbacks.get(name, ()))
        # Outside the lock, as wrapt does, so a callback that imports cannot deadlock.
        for callback in callbacks:
            callback(module)

    def find_spec(self, fullname: str, path: "Sequence[str] | None", target: object = None) -> "Any":
        if fullname not in self._callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)  # type: ignore[arg-type]
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallbackLoader(spec.loader, fullname, self)  # type: ignore[assignment]
                return spec
        return None

    def invalidate_caches(self) -> None:
        """Nothing cached; present because importlib.invalidate_caches() calls it on every finder."""


def finder() -> PostImportFinder:
    """The one finder of this process (found again on ``sys.meta_path`` after a reload)."""
    for entry in sys.meta_path:
        if type(entry).__name__ == "PostImportFinder" and type(entry).__module__ == __name__:
            return entry  # type: ignore[return-value]
    created = PostImportFinder()
    sys.meta_path.insert(0, created)
    return created


# --- activation ----------------------------------------------------------------------------------

activated = False
"""Whether :func:`activate` found the guard wanted, and registered the hook."""
startup_error: str | None = None
"""The one line start-up printed for a bad value, else None."""
loading = False
"""True while the post-import hook imports ``pallas_guard``: a bad value then must not leave the
process without the guard (``install_at_import`` installs it, and the first kernel raises)."""


def report_startup_error(error: BaseException) -> None:
    """Print the one start-up line for a bad setting (once per process, whoever reports it)."""
    global startup_error  # noqa: PLW0603 - read by doctor and the pytest plugin
    line = (
        "pallas_guard: " + " ".join(str(error).split()) + " (the guard stays installed: each Pallas kernel "
        "it sees raises this error until the value is fixed)."
    )
    startup_error = line
    say_once("_pallas_guard_startup_error", [line])


def _load_guard(module: "ModuleType") -> None:
    """Post-import callback for Pallas's public modules: ``import pallas_guard`` installs the guard.
    It runs inside the user's import of Pallas, which must not fail because of us: a guard that
    cannot arm says so on stderr, and each kernel that lowers for the CPU raises the reason."""
    del module
    global loading  # noqa: PLW0603
    loading = True
    try:
        import pallas_guard  # noqa: F401
    except Exception as error:
        sys.stderr.write(f"pallas_guard: could not be imported, the guard is off: {type(error).__name__}: {error}\n")
    finally:
        loading = False


def activate() -> None:
    """Start-up entry point (``.pth`` line, ``pallas_guard_autoload.start``, ``sitecustomize``). Never raises.

    A bad value does not switch the guard off: the line printed here says so, and the hook still
    installs the guard, whose first kernel raises the error, naming the variable.
    """
    global activated  # noqa: PLW0603
    if activated:
        return
    report_unknown_variables()  # a misspelled policy variable must not read as "no guard wanted"
    if not guard_wanted():
        return
    try:
        read_environment()
    except (ValueError, TypeError) as error:
        report_startup_error(error)
    activated = True
    for name in PALLAS_MODULES:
        finder().register(name, _load_guard)
