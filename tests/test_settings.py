"""Settings: the OPTIONS table, parsing, sources and precedence, the process values and scopes."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import run_python

import pallas_guard
from pallas_guard import Interpreter, PallasGuardConfigError, Policy
from pallas_guard._vocabulary import settings as _settings
from pallas_guard._vocabulary.settings import current_interpreter, current_policy, parse
from pallas_guard_autoload import (
    CHECKS_ENV,
    DETECT_RACES_ENV,
    DEVICE_ENV,
    FAST_PLAIN_ENV,
    INTERPRETER_ENV,
    MAX_STEPS_ENV,
    OPTIONS,
    PALLAS_INTERPRET_ENV,
    POLICY_ENV,
    REQUIRE_CHECKS_ENV,
    VMEM_HEADROOM_ENV,
    guard_wanted,
    read_environment,
)


@pytest.fixture(autouse=True)
def _no_guard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)
    _settings.reset()


# --- the table ---------------------------------------------------------------------------------------


def test_options_declare_each_setting_once() -> None:
    assert {name: (o.env, o.kind, o.default) for name, o in OPTIONS.items()} == {
        "policy": (POLICY_ENV, "policy", "warn"),
        "interpreter": (INTERPRETER_ENV, "interpreter", "auto"),
        "checks": (CHECKS_ENV, "set of checks", frozenset()),
        "fast_plain": (FAST_PLAIN_ENV, "boolean", True),
        "require_checks": (REQUIRE_CHECKS_ENV, "boolean", False),
        "device": (DEVICE_ENV, "device", "none"),
        "max_steps": (MAX_STEPS_ENV, "step budget", None),
        "vmem_headroom": (VMEM_HEADROOM_ENV, "share", 0.0),
    }
    # The older and the shared spellings are aliases of two rows, not rows of their own.
    assert OPTIONS["checks"].alias is not None and OPTIONS["checks"].alias.env == DETECT_RACES_ENV
    assert OPTIONS["policy"].alias is not None and OPTIONS["policy"].alias.env == PALLAS_INTERPRET_ENV
    # The public enums and the table accept the same words, listed in the same order.
    for name, enum_cls in (("policy", Policy), ("interpreter", Interpreter)):
        assert OPTIONS[name].accepted == ", ".join(repr(member.value) for member in enum_cls)
        for member in enum_cls:
            assert OPTIONS[name].parse(member.value.upper(), "test") == member.value
    assert all(option.help for option in OPTIONS.values())


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("policy", " Strict\n", "strict"),
        ("interpreter", "\tTPU", "tpu"),
        ("checks", " Races, BOUNDS", frozenset({"races", "bounds"})),
        ("checks", "all", frozenset({"races", "bounds", "lowering", "compile"})),
        ("checks", "All, agree", frozenset({"races", "bounds", "agree", "lowering", "compile"})),
        ("checks", "bounds,all", frozenset({"races", "bounds", "lowering", "compile"})),
        ("checks", "None", frozenset()),
        ("max_steps", " 512 ", 512),
        ("device", " TPU v5 lite ", "tpu-v5e"),
        ("device", "tpu-v5e, H100,tpu-v5e", "tpu-v5e,h100"),
        ("device", "TPU-v5e:2X4 ,h100", "tpu-v5e:2x4,h100"),
        ("device", "tpu v5p:02x2x2", "tpu-v5p:2x2x2"),
    ],
)
def test_every_option_parses_case_and_whitespace_insensitively(name: str, raw: str, expected: object) -> None:
    assert OPTIONS[name].parse(raw, "test") == expected
    assert OPTIONS[name].from_environment({OPTIONS[name].env: raw}) == expected


def test_all_is_every_check_but_those_asked_for_by_name_and_says_so_in_the_error() -> None:
    """What ``all`` leaves out is named, with why, in the table, and a near miss of ``all,agree`` is
    corrected to it; ``none`` is not a member of a list."""
    from pallas_guard_autoload import ALL_CHECKS, BY_NAME_ONLY, CHECKS

    assert set(BY_NAME_ONLY) == {"agree"} and all(BY_NAME_ONLY.values())
    assert set(CHECKS) - set(BY_NAME_ONLY) == ALL_CHECKS
    assert OPTIONS["checks"].parse(["all", "agree"], "test") == frozenset(CHECKS)
    assert OPTIONS["checks"].word(OPTIONS["checks"].parse("all", "test")) == "races,bounds,lowering,compile"
    for raw, suggestion in (("all,agre", "'all,agree'"), ("all,none", None)):
        with pytest.raises(PallasGuardConfigError) as raised:
            OPTIONS["checks"].parse(raw, "PALLAS_GUARD_CHECKS")
        message = str(raised.value)
        assert f"PALLAS_GUARD_CHECKS={raw!r}" in message and "'all' (every check but agree" in message
        assert (f"did you mean {suggestion}?" in message) if suggestion else "did you mean" not in message


@pytest.mark.parametrize(
    "raw",
    ["tpu-v5e:2x2x1", "tpu-v5p:2x2", "h100:2x2", "tpu-v5e:0x4", "tpu-v5e:2x128", "tpu-v5e:2x", "tpu-v5e:two"],
)
def test_a_slice_of_the_wrong_shape_or_of_a_gpu_is_refused_naming_what_is_accepted(raw: str) -> None:
    with pytest.raises(PallasGuardConfigError) as raised:
        OPTIONS["device"].parse(raw, "test")
    message = str(raised.value)
    assert repr(raw) in message and "'tpu-v5e:2x4'" in message
    assert "two sides for v5e and v6e, three for v4, v5p and tpu7x" in message


def test_the_devices_a_setting_lists_and_the_slice_it_names_for_a_generation() -> None:
    from pallas_guard_autoload import device_list, device_slice

    assert device_list("tpu-v5e:2x4,h100") == ("tpu-v5e", "h100")
    assert device_slice("tpu-v5e:2x4,tpu-v5p:2x2x2", "tpu-v5p") == (2, 2, 2)
    assert device_slice("tpu-v5e,h100", "tpu-v5e") is None


def test_read_environment_returns_the_variables_that_are_set() -> None:
    environ = {POLICY_ENV: " Strict ", DETECT_RACES_ENV: "yes", INTERPRETER_ENV: "  ", "OTHER": "x"}
    assert read_environment(environ) == {
        "policy": ("strict", POLICY_ENV),
        "checks": (frozenset({"races"}), DETECT_RACES_ENV),
    }
    assert read_environment({}) == {}
    with pytest.raises(
        PallasGuardConfigError, match="PALLAS_GUARD_DETECT_RACES='maybe' is not a valid pallas_guard boolean"
    ):
        read_environment({DETECT_RACES_ENV: "maybe"})


def test_only_the_policy_variable_asks_for_the_guard() -> None:
    assert guard_wanted({POLICY_ENV: "warn"})
    assert not guard_wanted({POLICY_ENV: " "})
    assert not guard_wanted({INTERPRETER_ENV: "plain", DETECT_RACES_ENV: "1"})


# --- precedence: scope > API > variable > default ---------------------------------------------------


def test_precedence_scope_then_api_then_variable_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert current_policy() == (Policy.WARN, "default")
    _settings.reset()
    monkeypatch.setenv(POLICY_ENV, "strict")
    assert current_policy() == (Policy.STRICT, POLICY_ENV)
    pallas_guard.set_policy("off")
    assert current_policy() == (Policy.OFF, "set_policy()")
    with pallas_guard.policy("interpret"):
        assert current_policy() == (Policy.INTERPRET, "pallas_guard.policy() scope")
    assert current_policy() == (Policy.OFF, "set_policy()")


def test_each_setting_has_its_own_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRETER_ENV, "tpu")
    pallas_guard.install("strict")
    assert current_policy() == (Policy.STRICT, "install(policy=...)")
    assert current_interpreter() == (Interpreter.TPU, INTERPRETER_ENV)


def test_a_bare_install_keeps_values_given_through_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable applies until the API sets a value, then no more."""
    monkeypatch.setenv(POLICY_ENV, "warn")
    pallas_guard.set_policy("strict")
    pallas_guard.install()
    assert current_policy() == (Policy.STRICT, "set_policy()")
    pallas_guard.install(interpreter="plain")
    pallas_guard.install()
    assert current_policy() == (Policy.STRICT, "set_policy()")
    assert current_interpreter() == (Interpreter.PLAIN, "install(interpreter=...)")


RELOAD = """
import importlib, pallas_guard
pallas_guard.set_policy("strict")
pallas_guard.install()
print("bare install():", pallas_guard.get_policy().value)
importlib.reload(pallas_guard)
print("reload:", pallas_guard.get_policy().value)
from pallas_guard._surfaces import install as _install; from pallas_guard._vocabulary import settings as _settings
print(_install.status().requested, _settings.current_policy().source)
"""


def test_set_policy_survives_a_bare_install_and_a_reload_in_a_fresh_process() -> None:
    """Neither resets a set_policy() to the environment's value."""
    result = run_python(RELOAD, env={POLICY_ENV: "warn"})
    assert result.stdout.splitlines()[:2] == ["bare install(): strict", "reload: strict"], result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2:] == ["True set_policy()"]


def test_a_bad_variable_makes_the_api_raise_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings load on first use: a bad variable is an error there, never a silent default."""
    monkeypatch.setenv(INTERPRETER_ENV, "cuda")
    for call in (pallas_guard.get_policy, pallas_guard.install):
        with pytest.raises(PallasGuardConfigError, match="PALLAS_GUARD_INTERPRETER='cuda' is not a valid"):
            call()


def test_a_look_alike_value_is_printed_escaped() -> None:
    """'warn' with a Cyrillic omega for the w, beside the accepted 'warn', must look different."""
    result = run_python("import pallas_guard", env={POLICY_ENV: "\u0461arn"})
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("pallas_guard.PallasGuardConfigError: PALLAS_GUARD_POLICY='\\u0461arn' is not")
    assert "\u0461" not in result.stderr
    with pytest.raises(PallasGuardConfigError, match=r"set_policy\(policy\)='\\u0461arn' is not"):
        pallas_guard.set_policy("\u0461arn")


# --- parsing, as every surface sees it -------------------------------------------------------------

BAD_VALUES = [
    "bogus",
    "interpreted",
    "warning",
    "STRICTLY",
    "of",
    "none",
    "true",
    "1",
    "auto",
    "interpret,warn",
    "inter pret",
    "'warn'",
    "warn!",
    "warn\tstrict",
    "stríct",
]


@pytest.mark.parametrize("raw", ["interpret", "WARN", "  Strict  ", "oFf\n", "\tinterpret"])
def test_env_policy_is_case_and_whitespace_insensitive(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, raw)
    assert current_policy() == (Policy(raw.strip().lower()), POLICY_ENV)


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_env_policy_unset_or_empty_means_warn(raw: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv(POLICY_ENV, raising=False)
    else:
        monkeypatch.setenv(POLICY_ENV, raw)
    pallas_guard.install()
    assert pallas_guard.get_policy() is Policy.WARN


@pytest.mark.parametrize("raw", BAD_VALUES)
def test_bad_env_policy_names_variable_value_and_accepted(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, raw)
    with pytest.raises(PallasGuardConfigError) as info:
        pallas_guard.install()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert POLICY_ENV in message
    assert ascii(raw) in message
    for accepted in ("'interpret'", "'warn'", "'strict'", "'off'"):
        assert accepted in message


@pytest.mark.parametrize("bad", [1, 2.5, b"warn", ["warn"], object()])
def test_api_wrong_type_is_type_error_naming_argument(bad: object) -> None:
    with pytest.raises(TypeError, match=r"set_policy\(policy\) must be a str, got"):
        pallas_guard.set_policy(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"install\(policy=\.\.\.\)"):
        pallas_guard.install(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"install\(interpreter=\.\.\.\)"):
        pallas_guard.install("warn", interpreter=bad)  # type: ignore[arg-type]


def test_set_policy_none_is_type_error() -> None:
    """None means "from the environment" only for install(); set_policy needs a value."""
    with pytest.raises(TypeError, match="got NoneType None"):
        pallas_guard.set_policy(None)  # type: ignore[arg-type]


def test_interpreter_member_is_not_a_policy() -> None:
    with pytest.raises(PallasGuardConfigError, match="not a valid pallas_guard policy"):
        pallas_guard.set_policy(Interpreter.AUTO)


def test_api_bad_value_is_config_error_naming_argument() -> None:
    with (
        pytest.raises(PallasGuardConfigError, match=r"policy\(policy\)='loud'.*'interpret', 'warn', 'strict', 'off'"),
        pallas_guard.policy("loud"),
    ):
        pass
    with pytest.raises(PallasGuardConfigError, match=r"interpreter=\.\.\.\)='cuda'.*'auto', 'plain', 'tpu', 'gpu'"):
        pallas_guard.install("warn", interpreter="cuda")


def test_bad_argument_changes_nothing() -> None:
    pallas_guard.set_policy("strict")
    with pytest.raises(PallasGuardConfigError):
        pallas_guard.install("nope")
    assert pallas_guard.get_policy() is Policy.STRICT


def test_strings_and_members_are_accepted() -> None:
    pallas_guard.set_policy(Policy.OFF)
    assert pallas_guard.get_policy() is Policy.OFF
    pallas_guard.set_policy(" Interpret ")
    assert pallas_guard.get_policy() is Policy.INTERPRET
    assert parse("policy", Policy.STRICT, "test") is Policy.STRICT
    assert Policy.WARN == "warn"
    assert isinstance(Policy.WARN, str)


def test_scope_overrides_and_restores_with_source() -> None:
    pallas_guard.set_policy("warn")
    with pallas_guard.policy("strict"):
        assert pallas_guard.get_policy() is Policy.STRICT
        assert current_policy().source == "pallas_guard.policy() scope"
        with pallas_guard.policy(Policy.OFF):
            assert pallas_guard.get_policy() is Policy.OFF
        with pallas_guard.policy(interpreter="plain"):
            assert pallas_guard.get_policy() is Policy.STRICT
        assert pallas_guard.get_policy() is Policy.STRICT
    assert pallas_guard.get_policy() is Policy.WARN
    assert current_policy().source == "set_policy()"


def test_scope_restores_after_exception() -> None:
    with pytest.raises(RuntimeError), pallas_guard.policy("off"):
        raise RuntimeError
    assert pallas_guard.get_policy() is Policy.WARN


def test_scope_is_thread_local() -> None:
    seen: dict[str, Policy] = {}
    barrier = threading.Barrier(4)

    def worker(name: str) -> None:
        with pallas_guard.policy(name):
            barrier.wait(timeout=10)
            seen[name] = pallas_guard.get_policy()
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=worker, args=(p.value,)) for p in Policy]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert seen == {p.value: p for p in Policy}
    assert pallas_guard.get_policy() is Policy.WARN


def test_scope_is_asyncio_task_local() -> None:
    async def task(policy: Policy) -> Policy:
        with pallas_guard.policy(policy):
            await asyncio.sleep(0.01)
            return pallas_guard.get_policy()

    async def main() -> list[Policy]:
        return list(await asyncio.gather(*(task(p) for p in Policy)))

    assert asyncio.run(main()) == list(Policy)


# --- integers, near misses, one error class -------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\u00b2", r"'\xb2'"),  # a superscript two: str.isdigit() says yes, int() says no
        ("9" * 5000, "'" + "9" * 40 + "'... (5000 characters)"),  # past int()'s 4300-digit limit
        ("1e3", "'1e3'"),
        ("\uff11", r"'\uff11'"),  # a fullwidth one, which int() would take
        ("1_000", "'1_000'"),
        ("+5", "'+5'"),
        ("0", "'0'"),
        ("-3", "'-3'"),
    ],
)
def test_every_integer_setting_refuses_what_is_not_plain_digits(
    monkeypatch: pytest.MonkeyPatch, raw: str, shown: str
) -> None:
    monkeypatch.setenv(MAX_STEPS_ENV, raw)
    with pytest.raises(PallasGuardConfigError) as error:
        read_environment()
    assert str(error.value).startswith(f"{MAX_STEPS_ENV}={shown} is not a valid pallas_guard step budget; ")


@pytest.mark.parametrize(
    ("value", "named"),
    [pytest.param(10**5000, "an int of 16610 bits", id="10**5000"), (-1, "-1"), ("1e3", "'1e3'"), (True, None)],
)
def test_install_refuses_an_integer_it_cannot_take_naming_the_argument(value: object, named: str | None) -> None:
    if named is None:  # a bool is not an int here
        with pytest.raises(TypeError, match=r"install\(max_steps=\.\.\.\) must be a str or int, got bool"):
            pallas_guard.install(max_steps=value)  # type: ignore[arg-type]
        return
    with pytest.raises(PallasGuardConfigError) as error:
        pallas_guard.install(max_steps=value)  # type: ignore[arg-type]
    assert str(error.value).startswith(f"install(max_steps=...)={named} is not a valid pallas_guard step budget")


@pytest.mark.parametrize(
    ("name", "typo", "meant"),
    [
        ("policy", "intepret", "interpret"),
        ("policy", "Stirct", "strict"),
        ("interpreter", "tpuu", "tpu"),
        ("checks", "race", "races"),
        ("checks", "races,bound", "races,bounds"),
    ],
)
def test_a_near_miss_names_the_closest_valid_value(name: str, typo: str, meant: str) -> None:
    with pytest.raises(PallasGuardConfigError) as error:
        OPTIONS[name].parse(typo, OPTIONS[name].env)
    assert str(error.value).endswith(f"; did you mean {meant!r}?")


def test_nothing_close_suggests_nothing() -> None:
    with pytest.raises(PallasGuardConfigError) as error:
        OPTIONS["policy"].parse("zzzzzz", POLICY_ENV)
    assert "did you mean" not in str(error.value)


def test_reloading_the_autoload_keeps_the_one_error_class_pallas_guard_catches() -> None:
    result = run_python(
        """
        import importlib, pallas_guard, pallas_guard_autoload
        before = pallas_guard.PallasGuardConfigError
        importlib.reload(pallas_guard_autoload)
        try:
            pallas_guard_autoload.OPTIONS["policy"].parse("loud", "x")
        except pallas_guard.PallasGuardConfigError:
            print("caught", pallas_guard_autoload.PallasGuardConfigError is before)
        """
    )
    assert result.stdout.split() == ["caught", "True"], result.stderr


@pytest.mark.parametrize(
    ("name", "value", "source", "advice"),
    [
        ("policy", "interpret", POLICY_ENV, "set PALLAS_GUARD_POLICY=interpret"),
        ("policy", "interpret", PALLAS_INTERPRET_ENV, "set PALLAS_GUARD_POLICY=interpret"),  # wins over the alias
        ("policy", "interpret", "default", "set PALLAS_GUARD_POLICY=interpret"),
        ("policy", "strict", "--pallas-guard-policy", "pass --pallas-guard-policy=strict"),
        (
            "max_steps",
            64,
            "pallas_guard_max_steps in pyproject.toml",
            "set pallas_guard_max_steps = 64 in pyproject.toml (or pass --pallas-guard-max-steps=64)",
        ),
        ("max_steps", 64, "@pytest.mark.pallas_guard on t.py::test", "use @pytest.mark.pallas_guard(max_steps=64)"),
        ("policy", "warn", "@pytest.mark.pallas_guard on t.py::test", "use @pytest.mark.pallas_guard('warn')"),
        ("checks", "none", "pallas_guard.policy() scope", "use pallas_guard.policy(checks='none')"),
        ("interpreter", "tpu", "install(interpreter=...)", "call pallas_guard.install(interpreter='tpu')"),
        ("policy", "interpret", "set_policy()", "call pallas_guard.set_policy('interpret')"),
        ("checks", frozenset({"bounds", "races"}), CHECKS_ENV, "set PALLAS_GUARD_CHECKS=races,bounds"),
    ],
)
def test_advice_is_phrased_for_the_surface_that_set_the_value(
    name: str, value: object, source: str, advice: str
) -> None:
    assert _settings.how_to_set(name, value, source) == advice


def test_the_pytest_page_lists_every_setting_with_its_option_ini_name_and_variable() -> None:
    from conftest import REPO_ROOT

    page = (REPO_ROOT / "docs" / "pytest.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and "--pallas-guard-" in line]
    for option in OPTIONS.values():
        row = next((r for r in rows if f"`{option.pytest_option}=" in r), None)
        assert row is not None, f"docs/pytest.md has no row for {option.pytest_option}"
        assert option.ini in row and option.variables()[0] in row, row
