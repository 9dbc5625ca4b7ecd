"""Threads and asyncio tasks, each in its own ``pallas_guard.policy(...)`` scope, running kernels.

Every call builds a fresh kernel function, so no call reuses another's traced or compiled kernel:
what each sees is decided for it, under its own scope. Each call site is its own (compiled from a
per-worker file name), so the warnings' locations are per worker too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_guard
from pallas_guard import PallasGuardError, PallasGuardWarning
from pallas_guard._vocabulary import record as _record

CALLS_PER_WORKER = 3

# Compiled once per worker under its own file name: call sites differ.
_CALLER = """
def call(pl, jax, kernel, x):
    return jax.jit(
        lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=kernel.__name__)(x)
    )(x)
"""


def _caller(worker: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(_CALLER, f"<worker {worker}>", "exec"), namespace)  # a constant source
    return namespace["call"]  # type: ignore[no-any-return]


def _fresh_kernel(worker: str, index: int, offset: float) -> Callable[..., None]:
    def kernel(x_ref, o_ref):  # type: ignore[no-untyped-def]
        o_ref[...] = x_ref[...] * 2 + offset

    kernel.__name__ = kernel.__qualname__ = f"kernel_{worker}_{index}"
    return kernel


# What each policy must do for a kernel lowered for the CPU: (outcome, recorded action, warned).
EXPECTED = {
    "interpret": ("ok", "interpreted", False),
    "warn": ("ok", "interpreted", True),
    "strict": ("PallasGuardError", "refused", False),
    "off": ("jax error", "untouched", False),
}


def _run_one(call: Callable[..., Any], worker: str, index: int) -> str:
    offset = float(index + 1)
    x = jnp.arange(8, dtype=jnp.float32)
    try:
        y = call(pl, jax, _fresh_kernel(worker, index, offset), x)
    except PallasGuardError:
        return "PallasGuardError"
    except ValueError as error:
        return "jax error" if "Only interpret mode is supported" in str(error) else repr(error)
    np.testing.assert_array_equal(y, np.arange(8, dtype=np.float32) * 2 + offset)
    return "ok"


def _check_records(workers: dict[str, str], outcomes: dict[str, list[str]]) -> None:
    records = pallas_guard.decisions()
    assert len(records) == len(workers) * CALLS_PER_WORKER  # one each: none lost, none doubled
    for worker, policy in workers.items():
        outcome, action, warned = EXPECTED[policy]
        assert outcomes[worker] == [outcome] * CALLS_PER_WORKER, (worker, policy)
        mine = [r for r in records if r.kernel.startswith(f"kernel_{worker}_")]
        assert sorted(r.kernel for r in mine) == [f"kernel_{worker}_{i}" for i in range(CALLS_PER_WORKER)]
        assert {r.policy.value for r in mine} == {policy}
        assert {r.action for r in mine} == {action}
        assert all(r.called_at and r.called_at.startswith(f"<worker {worker}>:") for r in mine), mine
        # Every call of a warn worker warns; how often it is shown is the warnings filters' business.
        assert [r.warned for r in mine] == [warned] * CALLS_PER_WORKER


POLICIES = ["interpret", "warn", "strict", "off"]


def test_eight_threads_each_in_its_own_scope() -> None:
    pallas_guard.install("strict")  # the process policy every scope overrides
    workers = {f"t{i}": POLICIES[i % len(POLICIES)] for i in range(8)}
    outcomes: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers))

    def work(worker: str, policy: str) -> None:
        try:
            call = _caller(worker)
            barrier.wait(timeout=60)
            with pallas_guard.policy(policy):
                assert pallas_guard.get_policy().value == policy
                outcomes[worker] = [_run_one(call, worker, i) for i in range(CALLS_PER_WORKER)]
                assert pallas_guard.get_policy().value == policy  # no other thread's scope leaked in
        except BaseException as error:  # reported below, from the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=item, name=item[0]) for item in workers.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasGuardWarning)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert pallas_guard.get_policy() is pallas_guard.Policy.STRICT  # the main thread's, untouched
    _check_records(workers, outcomes)


def test_asyncio_tasks_each_in_its_own_scope() -> None:
    """Tasks interleave on one loop inside their scopes; kernels run in worker threads
    (``asyncio.to_thread`` carries the task's context along)."""
    pallas_guard.install("interpret")
    workers = {f"a{i}": POLICIES[(i + 1) % len(POLICIES)] for i in range(6)}
    outcomes: dict[str, list[str]] = {worker: [] for worker in workers}

    async def task(worker: str, policy: str) -> None:
        call = _caller(worker)
        with pallas_guard.policy(policy):
            for index in range(CALLS_PER_WORKER):
                await asyncio.sleep(0)  # let the other tasks enter and run inside their scopes
                assert pallas_guard.get_policy().value == policy
                if index == 0:
                    outcomes[worker].append(_run_one(call, worker, index))  # on the loop's thread
                else:
                    outcomes[worker].append(await asyncio.to_thread(_run_one, call, worker, index))

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(task(w, p) for w, p in workers.items())), timeout=300)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasGuardWarning)
        asyncio.run(main())
    _check_records(workers, outcomes)


def test_records_from_many_threads_are_all_kept() -> None:
    """The record store alone, hammered: every append survives, in per-thread order."""
    threads, per_thread = 8, 2000
    template = _record.Decision(
        kernel="k",
        defined_at=None,
        called_at=None,
        platforms=("cpu",),
        policy=pallas_guard.Policy.WARN,
        action="interpreted",
        interpreter="plain",
        reason="test",
        layer="lowering",
    )

    def work(n: int) -> None:
        for i in range(per_thread):
            _record.add(dataclasses.replace(template, kernel=f"{n}:{i}"))

    pool = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    kernels = [d.kernel for d in pallas_guard.decisions()]
    assert len(kernels) == threads * per_thread
    for n in range(threads):
        assert [k for k in kernels if k.startswith(f"{n}:")] == [f"{n}:{i}" for i in range(per_thread)]


@pytest.fixture(autouse=True)
def _no_cached_kernels() -> None:
    jax.clear_caches()
