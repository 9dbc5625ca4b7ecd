"""The wrappers pickle like what they wrap, under every policy: the entry points by reference,
the kernel callables as the callables JAX returned (cloudpickle by value). Decisions pickle by
their public name, and one pickled before the modules moved into layer folders still loads."""

from __future__ import annotations

import functools
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ORIGINAL_PALLAS_CALL
from jax.experimental import pallas as pl

import pallas_guard


def add_one_kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
    o_ref[...] = x_ref[...] + 1


@pytest.mark.parametrize("policy", list(pallas_guard.Policy))
def test_entry_points_pickle_by_reference(guard: Callable[..., None], policy: str) -> None:
    guard(policy)
    assert pl.pallas_call is not ORIGINAL_PALLAS_CALL  # the wrapper is what gets pickled
    for entry_point in (pl.pallas_call, *([pl.kernel] if hasattr(pl, "kernel") else [])):
        assert pickle.loads(pickle.dumps(entry_point)) is entry_point
        assert cloudpickle.loads(cloudpickle.dumps(entry_point)) is entry_point
    partial = functools.partial(pl.pallas_call, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))
    restored = pickle.loads(pickle.dumps(partial))
    assert restored.func is pl.pallas_call and restored.keywords == partial.keywords


def test_a_pickled_entry_point_loads_the_original_once_the_guard_is_gone(guard: Callable[..., None]) -> None:
    guard("interpret")
    data = pickle.dumps(pl.pallas_call)
    pallas_guard.uninstall()
    assert pickle.loads(data) is ORIGINAL_PALLAS_CALL


@pytest.mark.parametrize("policy", ["interpret", "warn", "off"])  # strict refuses to build it
def test_kernel_callables_cloudpickle_as_what_jax_returned(guard: Callable[..., None], policy: str) -> None:
    guard(policy)
    x = jnp.arange(8, dtype=jnp.float32)
    kernel = pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    restored = cloudpickle.loads(cloudpickle.dumps(kernel))
    unguarded = ORIGINAL_PALLAS_CALL(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    # What JAX returned, pickled by value as without the guard (no pallas_guard needed to load it).
    assert type(restored) is type(unguarded) and callable(restored)
    assert type(pickle.loads(cloudpickle.dumps(kernel))) is type(unguarded)  # no proxy of ours inside


def test_kernel_callable_of_an_injected_interpreter_cloudpickles(guard: Callable[..., None]) -> None:
    """A kernel the front door gave TPU interpret mode: its pickle is JAX's callable with that choice."""
    guard("interpret", interpreter="tpu")
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    kernel = pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    np.testing.assert_array_equal(kernel(x), x + 1)
    restored = cloudpickle.loads(cloudpickle.dumps(kernel))
    assert callable(restored) and not hasattr(restored, "__wrapped__")


def _globals_named(data: bytes) -> set[str]:
    return {
        str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE" and "pallas" in str(arg)
    }


def test_a_decision_pickles_by_its_public_name(guard: Callable[..., None]) -> None:
    guard("interpret")
    jax.block_until_ready(
        pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))(jnp.zeros(8))
    )
    (decision,) = pallas_guard.decisions()
    data = pickle.dumps(decision, protocol=4)
    assert "pallas_guard._record" not in _globals_named(
        data
    ) and "pallas_guard._vocabulary.record" not in _globals_named(data)
    assert pickle.loads(data) == decision


def test_a_decision_pickled_before_the_layers_moved_loads() -> None:
    """Made by pallas_guard 0.1.0 with every module in one flat folder (class ``pallas_guard._record.Decision``)."""
    data = (Path(__file__).parent / "data" / "decision_pickled_by_0.1.0_flat.pickle").read_bytes()
    assert "pallas_guard._record" in _globals_named(data)
    decision = pickle.loads(data)
    assert isinstance(decision, pallas_guard.Decision)
    assert (decision.kernel, decision.action, decision.interpreter, decision.policy) == (
        "add_one",
        "interpreted",
        "plain",
        pallas_guard.Policy.INTERPRET,
    )
