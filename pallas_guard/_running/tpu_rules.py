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

import functools
import inspect
import sys
import threading
from typing import Any

from pallas_guard._jax import lookup as jax_lookup
from pallas_guard._jax import lowering as jax_lowering

PRIMITIVES_MODULE = "jax._src.pallas.mosaic.primitives"


def _bits(dtype: Any) -> int:
    import numpy as np
    from jax import dtypes

    itemsize_bits = getattr(dtypes, "itemsize_bits", None)
    return int(itemsize_bits(dtype)) if itemsize_bits is not None else np.dtype(dtype).itemsize * 8


def _word(width: int) -> Any:
    import jax.numpy as jnp

    return {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]


def pack_elementwise(*xs: Any, packed_dtype: Any, out_dtype: Any) -> Any:
    """Source ``i`` narrowed to ``packed_dtype`` at bits ``[i * w, (i + 1) * w)`` of each word
    (``out_dtype``: the primitive's own; jax before 0.10 packs into 32-bit words whatever the
    sources' width)."""
    import jax.numpy as jnp

    width = _bits(packed_dtype)
    mask = jnp.uint32((1 << width) - 1)
    word = jnp.zeros(xs[0].shape, jnp.uint32)
    for position, x in enumerate(xs):
        if jnp.issubdtype(packed_dtype, jnp.floating):
            field = _to_bfloat16_as_the_tpu(x)
        else:  # narrowing an integer keeps its low bits; widening to 32 bits first keeps them too
            field = x.astype(jnp.int32).astype(jnp.uint32) & mask
        word = word | (field << jnp.uint32(position * width))
    return word.astype(out_dtype)


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


def unpack_elementwise(x: Any, *, index: int, packed_dtype: Any, unpacked_dtype: Any, out_dtype: Any) -> Any:
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


def _with_out_dtype(function: Any, lower_fun: Any) -> Any:
    """``function`` as a CPU rule, told the dtype the primitive's abstract evaluation gives."""

    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        out_dtype = ctx.avals_out[0].dtype
        return lower_fun(functools.partial(function, out_dtype=out_dtype), multiple_results=False)(ctx, *args, **params)

    return rule


# --- PRNG ------------------------------------------------------------------------------------------
# ``pltpu.prng_seed`` sets a core's generator, ``pltpu.prng_random_bits`` draws from it. JAX's
# interpreters on a CPU have no rule for the first and TPU interpret mode returns zeros for the
# second: a dropout mask of zeros, silently. Here a seed becomes a 32-bit key (the seeds mixed by
# murmur3's finaliser) and each draw hashes (key, draw number, element index): the same seeds give
# the same bits, other seeds other bits, each draw new bits. Not the TPU's bits (its generator is
# the hardware's). A draw uses the seed set before it in the same block of the kernel body (where
# a kernel seeds at each grid step, as JAX's kernels do); a draw with no seed there is refused with
# the reason, never given zeros.

_GOLDEN = 0x9E3779B9
_STREAMS = 8
"""Seeds remembered per thread: a draw follows its seed within one kernel body."""


def _mix(h: Any) -> Any:
    """murmur3's 32-bit finaliser: every input bit flips about half the output bits."""
    import jax.numpy as jnp

    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> jnp.uint32(13))
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> jnp.uint32(16))


def _key(*seeds: Any) -> Any:
    import jax.numpy as jnp

    key = jnp.uint32(0x243F6A88)
    for seed in seeds:
        key = _mix(key ^ (jnp.asarray(seed).astype(jnp.uint32) + jnp.uint32(_GOLDEN)))
    return key


def _draw(key: Any, *, draw: int, shape: tuple[int, ...]) -> Any:
    import jax.numpy as jnp
    from jax import lax

    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the row-major element index, as broadcasts of iotas
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    stream = _mix(key ^ jnp.uint32((draw * _GOLDEN + 1) & 0xFFFFFFFF))
    return lax.bitcast_convert_type(_mix(_mix(index ^ stream) + stream), jnp.int32)


class _Seeded(threading.local):
    def __init__(self) -> None:
        self.streams: list[tuple[Any, Any, Any, list[int]]] = []
        """(MLIR module, block, the key's IR value, draws so far): the latest seeds lowered. The
        module is held so that its blocks stay alive: a freed block's address is never mistaken
        for a block of a later module."""


_seeded = _Seeded()


def _current_block() -> Any:
    ir: Any = getattr(jax_lookup.import_optional("jax._src.lib.mlir"), "ir", None)
    return ir.InsertionPoint.current.block


def seed_rule(ctx: Any, *seeds: Any) -> list[Any]:
    lower_fun = _lower_fun()
    (key,) = lower_fun(_key, multiple_results=False)(ctx, *seeds)
    module, block = ctx.module_context.module, _current_block()
    kept = [entry for entry in _seeded.streams if not (entry[0] is module and entry[1] == block)]
    _seeded.streams = [*kept[-(_STREAMS - 1) :], (module, block, key, [0])]
    return []


def random_bits_rule(ctx: Any, *, shape: tuple[int, ...]) -> Any:
    import jax.numpy as jnp
    from jax import core

    module, block = ctx.module_context.module, _current_block()
    stream = next((e for e in reversed(_seeded.streams) if e[0] is module and e[1] == block), None)
    if stream is None:
        raise NotImplementedError(
            "pltpu.prng_random_bits on a CPU (pallas_guard's rule): this draw has no pltpu.prng_seed before it "
            "in the same block of the kernel body (seeded in a branch, a loop or an earlier grid step, or drawn "
            "inside a function JAX lowers apart, as pltpu.stateful_uniform and the other stateful_* samplers do), "
            "so its bits cannot be given here; seed where you draw with prng_random_bits, or run the kernel on a TPU"
        )
    _, _, key, draws = stream
    shaped: Any = core.ShapedArray
    function = functools.partial(_draw, draw=draws[0], shape=tuple(shape))
    draws[0] += 1
    return _lower_fun()(function, multiple_results=False)(ctx.replace(avals_in=[shaped((), jnp.uint32)]), key)


def _lower_fun() -> Any:
    tools = jax_lowering.lowering_tools()
    assert tools is not None  # install() registers no rule without them
    return tools[2]


RULES = {"pack_elementwise_p": pack_elementwise, "unpack_elementwise_p": unpack_elementwise}
"""Primitive (by its name in ``PRIMITIVES_MODULE``) -> the function its CPU rule lowers."""
LOWERING_RULES = {"prng_seed_p": seed_rule, "prng_random_bits_p": random_bits_rule}
"""Primitive -> its CPU rule, which keeps what it needs across equations (the seed)."""


class Installed:
    """One CPU rule registered here, removed again on ``uninstall()`` (a hook: ``restore()``)."""

    def __init__(self, registry: jax_lowering.LoweringRegistry, primitive: Any, rule: Any, uncached: Any) -> None:
        self.registry, self.primitive, self.rule = registry, primitive, rule
        self.uncached = uncached
        """JAX's set of primitives lowered in place, where registering added this one; else None."""

    def restore(self) -> None:
        if jax_lowering.unwrap_rule(self.registry.cpu.get(self.primitive)) is self.rule:
            del self.registry.cpu[self.primitive]  # someone who registered over us keeps theirs
        if self.uncached is not None:
            self.uncached.discard(self.primitive)


def install(hooks: list[Any]) -> None:
    """Register a CPU rule for each primitive this jax has (once its module is imported) and gives
    no CPU rule of its own; each is added to ``hooks``."""
    module = sys.modules.get(PRIMITIVES_MODULE)
    registry = jax_lowering.lowering_registry()
    tools = jax_lowering.lowering_tools()
    if module is None or registry is None or tools is None:
        return
    lower_fun = tools[2]
    rules = {name: _with_out_dtype(function, lower_fun) for name, function in RULES.items()}
    # The PRNG rules keep state across equations: emitted in place, not cached as a function per
    # equation signature (which would put a seed and its draw in different functions).
    in_place = {"cacheable": False} if "cacheable" in inspect.signature(registry.register_lowering).parameters else {}
    for name, rule in {**rules, **LOWERING_RULES}.items():
        primitive = getattr(module, name, None)
        if primitive is None or primitive in registry.cpu:
            continue
        uncached = getattr(sys.modules.get("jax._src.interpreters.mlir"), "_uncacheable_primitives", None)
        added = name in LOWERING_RULES and isinstance(uncached, set) and primitive not in uncached
        registry.register_lowering(primitive, rule, platform="cpu", **(in_place if name in LOWERING_RULES else {}))
        hooks.append(Installed(registry, primitive, rule, uncached if added else None))
