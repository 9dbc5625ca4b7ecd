"""Locating JAX's interpreters across versions, and choosing one for a kernel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from . import _internals
from ._policy import Interpreter, Setting


class Choice(NamedTuple):
    name: str
    """``"plain"``, ``"tpu"`` or ``"gpu"``."""
    value: Any
    """The ``interpret=`` value to pass at trace time; None for plain (the net substitutes True)."""
    reason: str


def tpu_params_class() -> type | None:
    return _internals.first_attribute(
        [
            ("jax.experimental.pallas.tpu", "InterpretParams"),
            ("jax._src.pallas.mosaic.interpret.params", "InterpretParams"),
            ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "InterpretParams"),
            ("jax._src.pallas.mosaic.interpret", "InterpretParams"),
        ]
    )


def gpu_params_class() -> type | None:
    return _internals.first_attribute(
        [
            ("jax._src.pallas.mosaic_gpu.interpret.params", "InterpretGPUParams"),
            ("jax.experimental.pallas.mosaic_gpu", "InterpretGPUParams"),
            ("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call", "InterpretParams"),
        ]
    )


PLAIN = Choice("plain", None, "the plain interpreter runs single-device kernels correctly and fastest")


def _params(kind: str, **overrides: Any) -> Any | None:
    cls = tpu_params_class() if kind == "tpu" else gpu_params_class()
    if cls is None:
        _internals.note_missing(
            f"{kind.upper()} interpret params class", f"the {kind} interpreter is unavailable; using the plain one"
        )
        return None
    return cls(**overrides)


def choose(setting: Setting[Interpreter], kwargs: Mapping[str, Any]) -> Choice:
    """The interpreter for one kernel call: the user's forced one, else by the kernel's facts."""
    del kwargs  # per-kernel facts: see the real-kernels work
    forced = setting.value
    if forced is Interpreter.TPU or forced is Interpreter.GPU:
        value = _params(forced.value)
        if value is not None:
            return Choice(forced.value, value, f"interpreter {forced.value!r} forced by {setting.source}")
    if forced is Interpreter.PLAIN:
        return PLAIN._replace(reason=f"interpreter 'plain' forced by {setting.source}")
    return PLAIN
