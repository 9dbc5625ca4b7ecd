"""Compatibility by feature detection: JAX internals made to go missing, and a jax past the range.

Each test removes one internal the way a future jax might (the lookup in ``pallas_guard._jax`` finds
nothing) and checks the guard warns once naming it, keeps every layer that still works, and
refuses with a diagnostic where it would otherwise silently do nothing.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from conftest import ORIGINAL_PALLAS_CALL, REPO_ROOT, add, add_interpreted_by_hand, run_python
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard import PallasGuardError, PallasGuardWarning
from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import lowering as jax_lowering
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._surfaces import install as _install
from pallas_guard._vocabulary.entry_points import BY_LABEL


@pytest.fixture(autouse=True)
def _fresh_missing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no internal reported missing (the real ones are process-wide)."""
    monkeypatch.setattr(jax_lookup, "missing", {})
    monkeypatch.setattr(jax_lookup, "_warned_missing", set())
    yield
    pallas_guard.uninstall()  # before monkeypatch puts the real lookups back


def _install_recording(policy: str = "interpret", **kwargs: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pallas_guard.install(policy, **kwargs)  # type: ignore[arg-type]
    return [str(w.message) for w in caught if issubclass(w.category, PallasGuardWarning)]


def test_missing_registries_warn_once_keep_the_front_door_and_refuse(
    monkeypatch: pytest.MonkeyPatch, xs: jax.Array
) -> None:
    monkeypatch.setattr(jax_lowering, "lowering_registry", lambda: None)
    messages = _install_recording("interpret")
    assert len(messages) == 1
    assert "JAX internal 'jax.interpreters.mlir registries' not found in jax" in messages[0]
    assert jax.__version__ in messages[0]
    assert _install_recording("interpret") == []  # once per process, not per install
    assert pl.pallas_call is not ORIGINAL_PALLAS_CALL  # the front door still works ...
    assert _install.status().lowering_rules == ()
    with pytest.raises(PallasGuardError) as refused:  # ... and refuses instead of deferring to no net
        add(xs, xs)
    text = str(refused.value)
    assert "Policy 'strict' came from pallas_guard's fallback" in text
    assert "the CPU lowering net for pallas_call is not installed" in text
    assert "jax.interpreters.mlir registries" in text
    assert "policy 'interpret' (from install(policy=...))" in text
    (record,) = pallas_guard.decisions()
    assert (record.action, record.layer, record.policy) == ("refused", "front door", pallas_guard.Policy.INTERPRET)
    assert record.reason.startswith("falls back to strict")
    # What needs no net still works: the user's own interpret=True, and the trace-time TPU interpreter.
    np.testing.assert_array_equal(add_interpreted_by_hand(xs, xs), xs + xs)
    with pallas_guard.policy(interpreter="tpu"):
        np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert pallas_guard.decisions()[-1].interpreter == "tpu"
    # Policy off is off: JAX's own error, as without the guard.
    with pallas_guard.policy("off"), pytest.raises(ValueError, match="Only interpret mode is supported"):
        add(xs, xs)


def test_missing_pallas_call_primitive(monkeypatch: pytest.MonkeyPatch, xs: jax.Array) -> None:
    monkeypatch.setattr(jax_pallas, "pallas_call_primitive", lambda: None)
    messages = _install_recording("warn")
    assert [m for m in messages if "'pallas_call_p' not found" in m], messages
    status = _install.status()
    assert "pallas_call" in status.lowering_net_gaps
    if jax_pallas.has_mpmd_module():  # the other net (pl.kernel, jax >= 0.9.1) is still installed
        assert len(status.lowering_rules) == 1 and "mpmd_map" not in status.lowering_net_gaps
        assert _install.installation.lowering_net_gap(BY_LABEL["pl.kernel"]) is None
    with pytest.raises(PallasGuardError, match="CPU lowering net for pallas_call is not installed"):
        add(xs, xs)


def test_missing_common_rule(monkeypatch: pytest.MonkeyPatch, xs: jax.Array) -> None:
    primitive = jax_pallas.pallas_call_primitive()
    real = jax_lowering.LoweringRegistry.common_rule

    def common_rule(self: jax_lowering.LoweringRegistry, p: object) -> object:
        return None if p is primitive else real(self, p)

    monkeypatch.setattr(jax_lowering.LoweringRegistry, "common_rule", common_rule)
    messages = _install_recording("interpret")
    assert [m for m in messages if f"'lowering rule of {primitive}' not found" in m], messages
    with pytest.raises(PallasGuardError, match="lowering rule of pallas_call"):
        add(xs, xs)


def test_missing_mpmd_primitive_keeps_the_pallas_call_net(monkeypatch: pytest.MonkeyPatch, xs: jax.Array) -> None:
    if not jax_pallas.has_mpmd_module():
        pytest.skip("this jax has no mpmd_map (pl.kernel lowers through pallas_call_p before 0.9.1)")
    monkeypatch.setattr(jax_pallas, "mpmd_map_primitive", lambda: None)
    messages = _install_recording("interpret")
    assert [m for m in messages if "'mpmd_map_p' not found" in m], messages
    assert _install.installation.lowering_net_gap(BY_LABEL["pl.kernel"]) is not None
    assert _install.installation.lowering_net_gap(BY_LABEL["plgpu.kernel"]) is not None
    assert _install.installation.lowering_net_gap(BY_LABEL["pallas_call"]) is None
    np.testing.assert_array_equal(jax.jit(add)(xs, xs), xs + xs)  # pallas_call is still interpreted by the net
    assert pallas_guard.decisions()[-1].layer == "lowering"


def test_missing_tpu_interpreter_falls_back_to_plain(monkeypatch: pytest.MonkeyPatch, xs: jax.Array) -> None:
    monkeypatch.setattr(jax_pallas, "tpu_params_class", lambda: None)
    pallas_guard.install("interpret", interpreter="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert any("'TPU interpret params class' not found" in str(w.message) for w in caught)
    (record,) = pallas_guard.decisions()
    assert (record.action, record.interpreter) == ("interpreted", "plain")


def test_unknown_target_with_missing_net() -> None:
    """Before any backend exists the target is unknown: refuse only where JAX can only use the CPU."""
    result = run_python(
        """
import json
import pallas_guard
from pallas_guard._jax import config as jax_config, lowering as jax_lowering
from pallas_guard._deciding import target as _target
pallas_guard.uninstall()
jax_lowering.lowering_registry = lambda: None
import warnings; warnings.simplefilter("ignore")
import jax
from jax.experimental import pallas as pl
pallas_guard.install("interpret")
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
def f(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
spec = jax.ShapeDtypeStruct((8,), "float32")
outcomes = []
for plugins in ((), ("jax-cuda12-plugin 0.0.0",)):
    _target.installed_accelerator_plugins = lambda plugins=plugins: plugins
    try:
        jax.make_jaxpr(f)(spec)
        outcomes.append("deferred")
    except pallas_guard.PallasGuardError as error:
        outcomes.append(str(error).splitlines()[1])
print(json.dumps({"outcomes": outcomes, "backends": jax_config.backends_initialized()}))
""",
        env={"JAX_PLATFORMS": ""},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["outcomes"] == [
        "Why the target is the CPU: the target is not configured and no accelerator plugin is installed.",
        "deferred",  # with a plugin, JAX may well run it on its accelerator: left to JAX
    ]
    assert report["backends"] is False


# --- a jax newer than the tested range ----------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "warns"),
    [
        ("0.13.0", True),
        ("0.13.0.dev20270101", True),
        ("1.0", True),
        ("0.12.0.1", False),
        ("0.12.9rc1", False),
        ("0.7.2", False),
        ("unknown", False),
    ],
)
def test_newer_jax_is_a_notice_not_a_warning_and_keeps_working(
    monkeypatch: pytest.MonkeyPatch, xs: jax.Array, version: str, warns: bool
) -> None:
    """A jax past the range is reported by the pytest header and doctor; installing never warns."""
    monkeypatch.setattr(jax, "__version__", version)
    assert _install_recording("interpret") == []
    notice = jax_lookup.tested_range_notice()
    assert (notice is not None) == warns
    if notice is not None:
        assert notice.startswith(f"jax {version} is newer than the range pallas_guard was tested with (jax < 0.13)")
    # Every layer whose internals are found keeps working: nothing is switched off by version.
    assert pl.pallas_call is not ORIGINAL_PALLAS_CALL
    np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert [d.action for d in pallas_guard.decisions()] == ["interpreted"]


def test_behaviour_is_never_gated_on_the_version_string() -> None:
    """Feature detection, not version checks: ``__version__`` is read in one place, for messages."""
    package = REPO_ROOT / "pallas_guard"
    readers = [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if "__version__" in path.read_text()
        and path.relative_to(package).as_posix() not in {"_jax/lookup.py", "_surfaces/cli.py"}
    ]
    assert readers == []
    source = (package / "_jax" / "lookup.py").read_text()
    assert source.count("__version__") == 1


# --- probes of JAX never warn in the user's process ---------------------------------------------------


def test_arming_reads_no_name_jax_deprecated_under_warnings_as_errors(
    monkeypatch: pytest.MonkeyPatch, xs: jax.Array
) -> None:
    """A jax that serves a name the guard could read from a deprecating module ``__getattr__`` (as
    0.12.1 does ``pallas_call_p``): arming under ``simplefilter("error")`` reads the route JAX keeps,
    warns nothing, and the guard is armed."""
    primitive = jax_pallas.pallas_call_primitive()
    asked: list[str] = []

    def deprecated(name: str) -> object:
        asked.append(name)
        if name == "pallas_call_p":
            warnings.warn("pallas_call_p is internal to Pallas", DeprecationWarning, stacklevel=2)
            return primitive
        raise AttributeError(name)

    if "pallas_call_p" in vars(pl):  # jax < 0.12.1: a plain attribute, as it was
        monkeypatch.delattr(pl, "pallas_call_p")
    monkeypatch.setattr(pl, "__getattr__", deprecated, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pallas_guard.install("interpret")
        armed = _install.arm()
        np.testing.assert_array_equal(add(xs, xs), xs + xs)
    assert armed.armed, armed.text
    assert "pallas_call_p" not in asked
    assert [d.action for d in pallas_guard.decisions()] == ["interpreted"]


def test_a_probe_drops_what_jax_warns_and_keeps_the_guards_own_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX's warning inside a probe is dropped, under "error" too; the guard's own (a missing internal)
    is warned when the probe ends, under the user's filters; the user's once-per-location memory is
    left as it was (a warning shown before is not shown again)."""
    monkeypatch.setattr(jax_lookup, "missing", {})
    monkeypatch.setattr(jax_lookup, "_warned_missing", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            warnings.warn("the user's own", UserWarning, stacklevel=1)  # one location: shown once
            with jax_lookup.probing():
                warnings.warn("a JAX deprecation", DeprecationWarning, stacklevel=1)
                jax_lookup.note_missing("an internal", "a layer is off")
    assert [(w.category, str(w.message).split(";")[0]) for w in caught] == [
        (UserWarning, "the user's own"),
        (PallasGuardWarning, "pallas_guard: JAX internal 'an internal' not found in jax " + jax.__version__),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax_lookup.probing():
            warnings.warn("a JAX deprecation", DeprecationWarning, stacklevel=1)  # dropped, not raised


def test_the_supported_range_is_pyprojects_for_jax_jaxlib_and_the_tpu_extra() -> None:
    """One range: the dependency, jaxlib's, the ``tpu`` extra's (unbounded, pip backtracks through old
    jax[tpu] releases) and the one the guard's messages name."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    bound = jax_lookup.SUPPORTED.removeprefix("jax")
    assert f"jax{bound}" in project["dependencies"]
    assert f"jaxlib{bound}" in project["dependencies"]
    assert project["optional-dependencies"]["tpu"] == [f"jax[tpu]{bound}"]
    assert bound.endswith("<" + ".".join(map(str, jax_lookup.TESTED_BELOW)))
