"""The agree check compares what a kernel defines, once, and only where the computation runs.

Valid kernels that JAX's interpreters evaluate with different roundings, NaN payloads or
unwritten blocks give no finding; a real disagreement is still found; each interpreter runs once
on a first call, nothing runs under abstract evaluation; typed PRNG keys pass through.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard._checks import agree as _agree
from pallas_guard._deciding import interpreters as _interpreters

pytestmark = pytest.mark.skipif(not _interpreters.available("tpu"), reason="this jax has no TPU interpret mode")

SPEC = pl.BlockSpec((8, 128), lambda i: (i, 0))


def _rows(body: Any, dtype: Any = jnp.float32, rows: int = 32) -> Any:
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((rows, 128), dtype), grid=(rows // 8,), in_specs=[SPEC], out_specs=SPEC
    )


def transcendental(x_ref, o_ref):  # type: ignore[no-untyped-def]
    v = x_ref[...]
    o_ref[...] = jnp.tanh(v) + jnp.exp(v) * jax.lax.erf(v) - jnp.log1p(jnp.abs(v))


def fused_sums(x_ref, o_ref):  # type: ignore[no-untyped-def]
    v = x_ref[...]
    o_ref[...] = v * 1.7 + v * v - jnp.sin(v) * 0.5


def makes_nan(x_ref, o_ref):  # type: ignore[no-untyped-def]
    v = x_ref[...]
    o_ref[...] = jnp.log(v) * jnp.sqrt(v - 10.0)  # NaN for most inputs: payloads may differ


def skips_block_one(x_ref, o_ref):  # type: ignore[no-untyped-def]
    @pl.when(pl.program_id(0) != 1)  # block 1 never written, as block-skipping attention does
    def _() -> None:
        o_ref[...] = x_ref[...] + 1


def _x(dtype: Any = jnp.float32, rows: int = 32) -> jax.Array:
    return (jax.random.normal(jax.random.key(0), (rows, 128)) * 3).astype(dtype)


def _unchecked(call: Any, *args: Any) -> bytes:
    with pallas_guard.policy(checks="none"):
        return np.asarray(call(*args)).tobytes()


TRANSCENDENTALS = {
    # Functions whose XLA approximations differ between a fused and an unfused evaluation (jax
    # 0.12.0.1 measured 256-4096 ulps on the first; jax 0.10.2 4 ulps on JAX's flash attention).
    "inverse_hyperbolic": lambda v: (
        jnp.arcsinh(v) + jnp.arccosh(jnp.abs(v) + 1) + jnp.arctan2(v, v * 0.3 + 1) + jnp.cbrt(v)
    ),
    "tanh_exp_erf_log1p": lambda v: jnp.tanh(v) + jnp.exp(v) * jax.lax.erf(v) - jnp.log1p(jnp.abs(v)),
    "trigonometric": lambda v: jnp.sin(v) * jnp.cos(v) + jnp.tan(v * 0.1) + jnp.arcsin(jnp.tanh(v)) + jnp.arctan(v),
    "special": lambda v: jax.nn.sigmoid(v) + jax.lax.erf_inv(jnp.tanh(v) * 0.9) + jax.lax.lgamma(jnp.abs(v) + 0.5),
    "powers": lambda v: jnp.power(jnp.abs(v) + 0.1, 1.7) + jax.lax.rsqrt(jnp.abs(v) + 1) + jnp.expm1(v * 0.5),
    "softmax": lambda v: jax.nn.softmax(v, axis=-1) * 100,
    "reduction": lambda v: jnp.cumsum(v * v, axis=-1) - jnp.sum(v, axis=-1, keepdims=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("function", TRANSCENDENTALS, ids=str)
def test_transcendental_functions_of_every_float_dtype_give_no_finding(guard: Any, dtype: str, function: str) -> None:
    """Plain and TPU interpret mode both run each function; whatever they round differently on this
    jax, agree compares, finds nothing, and returns the unchecked bits."""
    fn = TRANSCENDENTALS[function]

    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = fn(x_ref[...]).astype(o_ref.dtype)

    guard("interpret", checks="agree")
    call = _rows(body, dtype)
    checked = np.asarray(call(_x(dtype))).tobytes()
    assert "agree: plain, tpu agree" in pallas_guard.decisions()[-1].tried
    assert checked == _unchecked(call, _x(dtype))


@pytest.mark.parametrize("body", [transcendental, fused_sums, makes_nan], ids=lambda f: f.__name__)
def test_valid_kernels_give_no_finding_and_the_unchecked_bits(guard: Any, body: Any) -> None:
    guard("interpret", checks="agree")
    call = _rows(body)
    checked = np.asarray(call(_x())).tobytes()
    tried = pallas_guard.decisions()[-1].tried
    assert "agree: plain, tpu agree" in tried, tried
    assert checked == _unchecked(call, _x())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bool_], ids=["float32", "int32", "bool"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_a_block_the_kernel_never_writes_is_no_disagreement(guard: Any, dtype: Any, traced: bool) -> None:
    """Plain leaves its fill in block 1 (NaN, the type's minimum, False), TPU interpret mode the
    previous step's block: neither is a value the kernel defined."""

    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        @pl.when(pl.program_id(0) != 1)
        def _() -> None:
            o_ref[...] = (x_ref[...] > 0).astype(dtype) if dtype == jnp.bool_ else x_ref[...].astype(dtype) + 1

    guard("interpret", checks="agree")
    call = _rows(body, dtype)
    out = jax.jit(call)(_x()) if traced else call(_x())
    jax.block_until_ready(out)
    assert not [d for d in pallas_guard.decisions() if d.action == "found"]


def _counting(counter: list[int]) -> Any:
    def body(x_ref, o_ref):  # type: ignore[no-untyped-def]
        jax.debug.callback(lambda: counter.append(1))
        o_ref[...] = x_ref[...] * 2

    return _rows(body, rows=8)


def test_each_interpreter_runs_once_on_a_first_call_and_the_result_is_the_chosen_ones(guard: Any) -> None:
    counter: list[int] = []
    guard("interpret", checks="agree")
    out = _counting(counter)(_x(rows=8))
    ran = [step for step in pallas_guard.decisions()[-1].tried if step.endswith(": ran")]
    assert len(counter) == len(ran) == 2  # plain and TPU interpret mode, once each: not the chosen one again
    np.testing.assert_array_equal(out, _x(rows=8) * 2)
    counter.clear()
    _counting(counter)(_x(rows=8))
    assert len(counter) == 1  # settled: only the chosen interpreter runs


def test_abstract_evaluation_runs_no_interpreter(guard: Any) -> None:
    counter: list[int] = []
    guard("interpret", checks="agree")
    call = _counting(counter)
    jax.eval_shape(call, _x(rows=8))
    jax.jit(call).lower(_x(rows=8))
    jax.jit(call).trace(_x(rows=8))
    assert counter == []
    jax.block_until_ready(jax.jit(call)(_x(rows=8)))  # computed: the chosen one, then the others compared once
    assert len(counter) == 2
    counter.clear()
    jax.block_until_ready(jax.jit(call)(_x(rows=8)))
    assert len(counter) == 1


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_typed_prng_keys_pass_through(guard: Any, traced: bool) -> None:
    def body(k_ref, x_ref, o_ref):  # type: ignore[no-untyped-def]
        del k_ref
        o_ref[...] = x_ref[...] + 1

    call = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec()],
    )
    guard("interpret", checks="agree")
    keys = jax.random.split(jax.random.key(0), 4)
    run = jax.jit(call) if traced else call
    np.testing.assert_array_equal(run(keys, jnp.zeros((8, 128))), np.ones((8, 128)))


def _differs(a: Any, b: Any) -> bool:
    return (
        _agree.compare_outputs({"plain": [np.asarray(a)], "tpu": [np.asarray(b)]}, ["plain", "tpu"], fills={})
        is not None
    )


def test_rounding_is_no_disagreement_and_a_wrong_value_is() -> None:
    """NaN equals NaN whatever its payload; floats differing by rounding relative to the output's
    magnitude agree; a zero, a NaN, an infinity or a stale value where the other computed a value
    of the output's magnitude disagree; integers and booleans compare bit for bit."""
    values = np.linspace(-4.0, 4.0, 16, dtype=np.float32)
    other_nan = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]
    assert not _differs(np.array([np.nan, 1.0], np.float32), np.array([other_nan, 1.0], np.float32))
    near_zero = values.copy()
    near_zero[7] += 4096 * np.finfo(np.float32).eps  # far in ulps of a small value, not of the output's
    assert not _differs(values, near_zero)
    for wrong in (0.0, np.nan, np.inf, values[3] * 0.9):
        dropped = values.copy()
        dropped[3] = wrong
        assert _differs(values, dropped), wrong
    assert _differs(np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32) + np.eye(8, dtype=np.int32)[2])
    assert _differs(np.ones(4, bool), np.array([True, False, True, True]))
    assert not _differs(values.astype(jnp.bfloat16), (values * (1 + 2**-8)).astype(jnp.bfloat16))


def test_under_vmap_the_comparison_is_not_traced_and_the_note_says_so(guard: Any) -> None:
    guard("interpret", checks="agree")
    call = _rows(transcendental, rows=8)
    out = jax.vmap(call)(jnp.stack([_x(rows=8)] * 2))
    np.testing.assert_array_equal(out[0], out[1])
    notes = pallas_guard.decisions()[-1].notes
    assert any(note.startswith("agree: not checked: called under a transformation other than jit") for note in notes)


def test_under_vmap_of_a_kernel_without_operands_the_comparison_is_not_traced(guard: Any) -> None:
    # No operand carries the batching: the guard reads the trace it is called under.
    guard("interpret", checks="agree", device="tpu-v5e")
    shape = jax.ShapeDtypeStruct((8, 128), jnp.int32)

    def programs(o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = jnp.full_like(o_ref, pl.num_programs(0))

    call = pl.pallas_call(programs, grid=(8,), out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)), out_shape=shape)
    out = jax.jit(jax.vmap(call, axis_size=2))()
    np.testing.assert_array_equal(out, np.full((2, 8, 128), 8))
    notes = pallas_guard.decisions()[-1].notes
    assert any(note.startswith("agree: not checked: called under a transformation other than jit") for note in notes)


def test_a_kernel_without_operands_is_compared_under_jit_and_the_process_lives() -> None:
    # Its TPU interpret mode call, jitted inside the comparison's branch, once made XLA (jax 0.12)
    # abort the process while compiling: run in a process of its own.
    from conftest import clean_env, run_python

    result = run_python(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.experimental import pallas as pl
        import pallas_guard
        pallas_guard.install("interpret", checks="agree", device="tpu-v5e")

        def programs(o_ref):
            o_ref[...] = jnp.full_like(o_ref, pl.num_programs(0))

        spec = pl.BlockSpec((8, 128), lambda i: (0, 0))
        shape = jax.ShapeDtypeStruct((8, 128), jnp.int32)
        out = jax.jit(pl.pallas_call(programs, grid=(8,), out_specs=spec, out_shape=shape))()
        print(np.unique(out).tolist(), pallas_guard.decisions()[-1].notes)
        """,
        env=clean_env({"JAX_PLATFORMS": "cpu"}),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[8] ('agree: plain, tpu agree',)"


def test_a_vmap_of_the_jitted_function_batches_it_uncompared_and_the_note_says_so(guard: Any) -> None:
    # The guard traced the comparison under jit, unbatched; the vmap batches that trace after.
    from pallas_guard._jax import tracing as jax_tracing

    if jax_tracing.batching_rule_of_our_own() is None:
        pytest.skip("jax 0.7 drops a custom_vmap call whose result is unused: it cannot batch the comparison")
    guard("interpret", checks="agree", device="tpu-v5e")
    call = _rows(transcendental, rows=8)
    xs = jnp.stack([_x(rows=8), _x(rows=8) * 2])
    out = jax.vmap(jax.jit(call))(xs)
    assert np.asarray(out).tobytes() == _unchecked(jax.vmap(jax.jit(call)), xs)
    notes = pallas_guard.decisions()[-1].notes
    assert "agree: not checked: called under jax.vmap (batched after the guard traced it)" in notes


def test_a_comparison_traced_but_never_run_is_forgotten_at_uninstall() -> None:
    """Lowering a jitted call traces the comparison's gate without running it; uninstall() drops
    it, so no later call waits for a gate of a guard that is gone."""
    from pallas_guard._running import findings as _findings

    pallas_guard.install("interpret", checks="agree")
    jax.jit(_rows(transcendental)).lower(_x())
    assert _findings._awaited
    pallas_guard.uninstall()
    assert not _findings._awaited and not _findings._handed_over
