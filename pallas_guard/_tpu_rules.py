"""CPU rules of the guard's own for TPU primitives that no interpreter runs on a CPU.

``pltpu.pack_elementwise`` and ``pltpu.unpack_elementwise`` have a Mosaic lowering and nothing else:
the plain interpreter and TPU interpret mode both end in "MLIR translation rule for primitive ...
not found for platform cpu". Their semantics are defined bit for bit (JAX's docstrings and tests):
packing narrows each source (integers to their low bits; float32 to bfloat16 as a TPU v5e does:
rounded to nearest even, subnormals flushed to zero, every NaN the quiet NaN 0x7fc0) and places
source ``i`` at bits ``[i * width, (i + 1) * width)`` of an unsigned word as wide as a source;
unpacking takes field ``index`` back and widens it (sign-extended for signed integers; a bfloat16
field's bits, subnormals flushed to zero, NaNs the quiet NaN). The rules are registered for the CPU
only, while the guard is installed, and only where this jax has no CPU rule of its own;
``tests/test_tpu_rules.py`` holds them against the outputs a TPU v5e gave
(``tests/data/tpu_v5e_records.json``).
"""

from __future__ import annotations

import sys
from typing import Any

from . import _internals

PRIMITIVES_MODULE = "jax._src.pallas.mosaic.primitives"


def _bits(dtype: Any) -> int:
    import numpy as np
    from jax import dtypes

    itemsize_bits = getattr(dtypes, "itemsize_bits", None)
    return int(itemsize_bits(dtype)) if itemsize_bits is not None else np.dtype(dtype).itemsize * 8


def _word(width: int) -> Any:
    import jax.numpy as jnp

    return {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]


def pack_elementwise(*xs: Any, packed_dtype: Any) -> Any:
    """Source ``i`` narrowed to ``packed_dtype`` at bits ``[i * w, (i + 1) * w)`` of each word."""
    import jax.numpy as jnp

    source_width, width = _bits(xs[0].dtype), _bits(packed_dtype)
    mask = jnp.uint32((1 << width) - 1)
    word = jnp.zeros(xs[0].shape, jnp.uint32)
    for position, x in enumerate(xs):
        if jnp.issubdtype(packed_dtype, jnp.floating):
            field = _to_bfloat16_as_the_tpu(x)
        else:  # narrowing an integer keeps its low bits; widening to 32 bits first keeps them too
            field = x.astype(jnp.int32).astype(jnp.uint32) & mask
        word = word | (field << jnp.uint32(position * width))
    return word.astype(_word(source_width))


def _to_bfloat16_as_the_tpu(x: Any) -> Any:
    """float32 -> bfloat16 bits (in a uint32) as a TPU v5e packs them (measured): subnormals
    flushed to zero keeping their sign, every NaN the positive quiet NaN 0x7fc0, the rest rounded to
    nearest even."""
    import jax.numpy as jnp
    from jax import lax

    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    flushed = jnp.where((bits & jnp.uint32(0x7F800000)) == 0, bits & jnp.uint32(0x80000000), bits)
    value = lax.bitcast_convert_type(flushed, jnp.float32).astype(jnp.bfloat16)
    field = lax.bitcast_convert_type(value, jnp.uint16).astype(jnp.uint32)
    return jnp.where(jnp.isnan(x), jnp.uint32(0x7FC0), field)


def unpack_elementwise(x: Any, *, index: int, packed_dtype: Any, unpacked_dtype: Any) -> Any:
    """Field ``index`` of each word of ``x`` as ``packed_dtype``, widened to ``unpacked_dtype``."""
    import jax.numpy as jnp
    from jax import lax

    width = _bits(packed_dtype)
    raw = lax.bitcast_convert_type(x, _word(_bits(x.dtype))).astype(jnp.uint32)
    field = (raw >> jnp.uint32(index * width)) & jnp.uint32((1 << width) - 1)
    if jnp.issubdtype(packed_dtype, jnp.floating):  # bfloat16 -> float32: its bits, widened
        # As a TPU v5e unpacks (measured): subnormals flushed to zero, every NaN the quiet NaN.
        exponent, mantissa = field & jnp.uint32(0x7F80), field & jnp.uint32(0x007F)
        field = jnp.where(exponent == 0, field & jnp.uint32(0x8000), field)
        field = jnp.where((exponent == 0x7F80) & (mantissa != 0), jnp.uint32(0x7FC0), field)
        return lax.bitcast_convert_type(field << jnp.uint32(16), jnp.float32).astype(unpacked_dtype)
    signed = field.astype(jnp.int32)
    if jnp.issubdtype(packed_dtype, jnp.signedinteger):
        signed = jnp.where(signed >= (1 << (width - 1)), signed - (1 << width), signed)
    return signed.astype(unpacked_dtype)


RULES = {"pack_elementwise_p": pack_elementwise, "unpack_elementwise_p": unpack_elementwise}
"""Primitive (by its name in ``PRIMITIVES_MODULE``) -> the function its CPU rule lowers."""


class Installed:
    """One CPU rule registered here, removed again on ``uninstall()`` (a hook: ``restore()``)."""

    def __init__(self, registry: _internals.LoweringRegistry, primitive: Any, rule: Any) -> None:
        self.registry, self.primitive, self.rule = registry, primitive, rule

    def restore(self) -> None:
        if _internals.unwrap_rule(self.registry.cpu.get(self.primitive)) is self.rule:
            del self.registry.cpu[self.primitive]  # someone who registered over us keeps theirs


def install(hooks: list[Any]) -> None:
    """Register a CPU rule for each primitive this jax has (once its module is imported) and gives
    no CPU rule of its own; each is added to ``hooks``."""
    module = sys.modules.get(PRIMITIVES_MODULE)
    registry = _internals.lowering_registry()
    tools = _internals.lowering_tools()
    if module is None or registry is None or tools is None:
        return
    lower_fun = tools[2]
    for name, function in RULES.items():
        primitive = getattr(module, name, None)
        if primitive is None or primitive in registry.cpu:
            continue
        rule = lower_fun(function, multiple_results=False)
        registry.register_lowering(primitive, rule, platform="cpu")
        hooks.append(Installed(registry, primitive, rule))
