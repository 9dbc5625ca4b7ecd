"""The kernels JAX ships in ``jax.experimental.pallas.ops``, as a test corpus.

Each :class:`Case` imports a shipped op (never a copy), builds small inputs, calls the op the way
a user would on a GPU/TPU machine (no ``interpret=`` anywhere), and compares with a plain
``jax.numpy`` reference written here, at stated tolerances. ``expected`` is the interpreter the
guard should choose for it on the CPU; ``xfail`` says why no interpreter can run it (only then).

Which ops exist depends on the jax version: :func:`cases` feature-detects them (a case whose module
or function is missing is left out), so one corpus serves jax 0.7.2 .. 0.12.x. Importable from
``tests/`` and from ``benchmarks/kernels.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

OPS = "jax.experimental.pallas.ops"

# Why a Mosaic-GPU kernel that asks the device for its SM count cannot run on any CPU interpreter.
CORE_COUNT = (
    "its host code asks `jax.devices()[0].core_count` (the GPU's SM count) before any kernel is traced; "
    "a CPU device has no such attribute and the device setting leaves jax.devices() alone, so no "
    "interpreter gets to run it"
)
HOPPER_CORE_COUNT = (
    "jax < 0.10's hopper_matmul_mgpu asks `backend.get_default_device().core_count` (the GPU's SM count) "
    "without consulting the abstract device (from 0.10 it asks the abstract device first), so even "
    "device='h100' cannot answer it on a CPU (and jax < 0.9 has no Mosaic-GPU interpreter)"
)
BLACKWELL = (
    "a Blackwell (sm_100) kernel: it allocates tensor memory (TMEM) and collective scratch, which neither "
    "the Mosaic-GPU interpreter nor the plain one models (older jax: its host code asks for core_count first)"
)
NO_GPU_INTERPRETER = (
    "a Mosaic-GPU kernel, and this jax has no Mosaic-GPU interpreter (jax >= 0.9.0); the plain and TPU "
    "interpreters do not implement its primitives"
)
RAGGED_PAGED = (
    "from jax 0.10 the plain interpreter fails on it (the swap discharge rule gets a static int index: "
    "'TypedInt' object has no attribute 'shape') and TPU interpret mode cannot read through its reshaped "
    "refs ('ReshapeTransform' object has no attribute 'indices'); it passes with the plain one on 0.7-0.9"
)
GPU_INTERPRETER_EFFECTS = (
    "jax 0.9's Mosaic-GPU interpreter fails inside this kernel's scan "
    "(`JaxprInputEffect Read<0> does not have corresponding jaxpr input`); it passes from jax 0.10"
)
CUDA_VERSIONS = (
    "its host code queries the CUDA runtime version (`cuda_versions`), which jaxlib has only with a "
    "CUDA plugin; no interpreter gets to run it"
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One shipped kernel, called as a user would, with a reference to check it against."""

    name: str
    family: str
    """``"triton"``, ``"mosaic_tpu"`` or ``"mosaic_gpu"``: what the kernel was written for."""
    module: str
    """The ``jax.experimental.pallas.ops`` module the op lives in (relative)."""
    inputs: Callable[[], tuple[Any, ...]]
    call: Callable[..., Any]
    """``call(op_module, *inputs)``: the op as a user calls it, with no ``interpret=``."""
    reference: Callable[..., Any]
    """``reference(*inputs)`` in plain ``jax.numpy``."""
    rtol: float = 1e-5
    atol: float = 1e-5
    expected: str = "plain"
    """The interpreter the guard should choose: ``"plain"``, ``"tpu"`` or ``"gpu"``."""
    xfail: str | None = None
    """Why no interpreter can run it on the CPU; None when one can."""
    devices: int = 1
    """CPU devices the case needs (multi-device cases run with forced host devices)."""
    requires: Sequence[str] = ()
    """Attributes of the op module the case needs (feature detection)."""
    skip: Callable[[Any], str | None] | None = None
    """``skip(op_module)``: why this jax's op cannot be checked at all (a bug in the op itself)."""
    device: str | None = None
    """The guard's ``device`` setting the case runs with: host code that asks which GPU/TPU it is on."""

    def skip_reason(self) -> str | None:
        return None if self.skip is None else self.skip(self.op_module())

    def op_module(self) -> Any:
        return importlib.import_module(f"{OPS}.{self.module}")

    def run(self) -> Any:
        return self.call(self.op_module(), *self.inputs())

    def expected_output(self) -> Any:
        return self.reference(*self.inputs())


def _rand(seed: int, *shape: int, dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float = 1.0) -> jax.Array:
    """Softmax attention on [..., q_len, d] x [..., kv_len, d]."""
    logits = jnp.einsum("...qd,...kd->...qk", q, k, precision="highest") * scale
    if causal:
        q_len, kv_len = logits.shape[-2:]
        mask = jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]
        logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(logits, axis=-1), v, precision="highest")


def _grads(f: Callable[..., jax.Array], *args: jax.Array, argnums: tuple[int, ...] = (0, 1, 2)) -> Any:
    return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=argnums)(*args)


# --- Triton (GPU) kernels -------------------------------------------------------------------------


def _mha_inputs() -> tuple[jax.Array, ...]:
    # [batch, seq, heads, head_dim]
    return (_rand(0, 1, 32, 2, 16), _rand(1, 1, 32, 2, 16), _rand(2, 1, 32, 2, 16))


def _mha_ref(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False) -> jax.Array:
    out = _attention(*(jnp.swapaxes(t, 1, 2) for t in (q, k, v)), causal=causal)
    return jnp.swapaxes(out, 1, 2)


def _mha(m: Any, q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False) -> jax.Array:
    sizes = m.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16)
    return m.mha(q, k, v, None, causal=causal, block_sizes=sizes)


def _layer_norm_ref(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * w + b


def _rms_norm_ref(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w + b


def _norm_inputs() -> tuple[jax.Array, ...]:
    # The ops vmap a per-row kernel twice: x is [batch, seq, features].
    return (_rand(3, 2, 4, 128), 1.0 + 0.1 * _rand(4, 128), 0.1 * _rand(5, 128))


def _decode_inputs() -> tuple[jax.Array, ...]:
    # mqa: q [batch, heads, d], k/v [batch, seq, d]
    return (_rand(6, 2, 16, 16), _rand(7, 2, 64, 16), _rand(8, 2, 64, 16))


def _mqa_ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    scale = 1 / math.sqrt(q.shape[-1])
    return _attention(q, k, v, scale=scale)


def _gqa_inputs() -> tuple[jax.Array, ...]:
    # q [batch, q_heads, d], k/v [batch, seq, kv_heads, d]
    return (_rand(9, 1, 16, 16), _rand(10, 1, 64, 1, 16), _rand(11, 1, 64, 1, 16))


def _gqa_ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    kv_heads = k.shape[2]
    k = jnp.repeat(jnp.swapaxes(k, 1, 2), q.shape[1] // kv_heads, axis=1)  # [b, q_heads, seq, d]
    v = jnp.repeat(jnp.swapaxes(v, 1, 2), q.shape[1] // kv_heads, axis=1)
    scale = 1 / math.sqrt(q.shape[-1])
    return _attention(q[:, :, None, :], k, v, scale=scale)[:, :, 0, :]


def _paged_inputs(
    *, batch: int = 2, heads: int = 16, kv_heads: int = 2, d: int = 16, page: int = 16, pages: int = 4
) -> tuple[jax.Array, ...]:
    q = _rand(12, batch, heads, d)
    total = batch * pages
    k_pages = _rand(13, kv_heads, total, page, d)
    v_pages = _rand(14, kv_heads, total, page, d)
    tables = jax.random.permutation(jax.random.key(15), total).reshape(batch, pages).astype(jnp.int32)
    lengths = jnp.array([page * pages - 5, page * 2 + 3][:batch], jnp.int32)
    return q, k_pages, v_pages, tables, lengths


def _paged_ref(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array
) -> jax.Array:
    batch, heads, d = q.shape
    kv_heads, _, _page, _ = k_pages.shape
    outs = []
    for b in range(batch):
        k = k_pages[:, tables[b]].reshape(kv_heads, -1, d)  # [kv_heads, seq, d]
        v = v_pages[:, tables[b]].reshape(kv_heads, -1, d)
        k = jnp.repeat(k, heads // kv_heads, axis=0)
        v = jnp.repeat(v, heads // kv_heads, axis=0)
        logits = jnp.einsum("hd,hkd->hk", q[b], k, precision="highest")
        logits = jnp.where(jnp.arange(k.shape[1])[None] < lengths[b], logits, -jnp.inf)
        outs.append(jnp.einsum("hk,hkd->hd", jax.nn.softmax(logits, -1), v, precision="highest"))
    return jnp.stack(outs)


# --- Mosaic-TPU kernels ---------------------------------------------------------------------------


def _flash_inputs() -> tuple[jax.Array, ...]:
    # [batch, heads, seq, d]
    return (_rand(20, 1, 2, 128, 64), _rand(21, 1, 2, 128, 64), _rand(22, 1, 2, 128, 64))


def _flash(m: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return m.flash_attention(q, k, v, causal=True, sm_scale=0.125)


def _gmm_inputs() -> tuple[jax.Array, ...]:
    lhs = _rand(23, 256, 128)
    rhs = _rand(24, 2, 128, 128)
    return lhs, rhs, jnp.array([100, 156], jnp.int32)


def _gmm_ref(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(lhs.shape[0]), side="right")
    return jnp.einsum("mk,mkn->mn", lhs, rhs[group], precision="highest")


def _tgmm_inputs() -> tuple[jax.Array, ...]:
    return _rand(25, 128, 256), _rand(26, 256, 128), jnp.array([100, 156], jnp.int32)


def _tgmm_ref(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(lhs.shape[1])
    return jnp.stack(
        [
            jnp.einsum("km,mn->kn", lhs * ((rows >= s) & (rows < e))[None], rhs, precision="highest")
            for s, e in zip(starts, ends, strict=True)
        ]
    )


def _gmm_grad(m: Any, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> Any:
    return _grads(lambda a, b: m.gmm(a, b, sizes), lhs, rhs, argnums=(0, 1))


def _gmm_grad_ref(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> Any:
    return _grads(lambda a, b: _gmm_ref(a, b, sizes), lhs, rhs, argnums=(0, 1))


def _tpu_paged_inputs() -> tuple[jax.Array, ...]:
    q, k_pages, v_pages, tables, lengths = _paged_inputs(heads=4, kv_heads=2, d=128, page=16, pages=4)
    return q, k_pages, v_pages, lengths, tables


def _tpu_paged(m: Any, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tables: jax.Array) -> jax.Array:  # noqa: PLR0917 - the op's own positional arguments
    return m.paged_attention(q, k, v, lengths, tables, pages_per_compute_block=2)


def _tpu_paged_ref(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tables: jax.Array) -> jax.Array:
    return _paged_ref(q, k, v, tables, lengths)


def _splash_inputs() -> tuple[jax.Array, ...]:
    # [heads, seq, d]
    return _rand(27, 2, 256, 128), _rand(28, 2, 256, 128), _rand(29, 2, 256, 128)


def _splash(m: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    mask_lib = importlib.import_module(f"{OPS}.tpu.splash_attention.splash_attention_mask")
    heads, seq = q.shape[:2]
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq, seq)) for _ in range(heads)])
    sizes = m.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    kernel = m.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    return kernel(q, k, v)


def _ragged_paged_inputs() -> tuple[Any, ...]:
    # Two sequences: one prefill of 5 tokens over 20 kv tokens, one decode token over 9 kv tokens.
    heads, kv_heads, d, page, _pages_per_seq = 4, 2, 128, 16, 2
    q = _rand(30, 8, heads, d)
    kv_pages = _rand(31, 6, page, 2 * kv_heads, d)
    kv_lens = jnp.array([20, 9, 0], jnp.int32)
    page_indices = jnp.array([[1, 3], [4, 0], [0, 0]], jnp.int32)
    cu_q_lens = jnp.array([0, 5, 6, 6], jnp.int32)
    return q, kv_pages, kv_lens, page_indices, cu_q_lens, jnp.array([2], jnp.int32)


def _ragged_paged(m: Any, q: Any, kv: Any, kv_lens: Any, pages: Any, cu: Any, num: Any) -> jax.Array:  # noqa: PLR0917 - the op's own positional arguments
    out = m.ragged_paged_attention(
        q, kv, kv_lens, pages, cu, num, sm_scale=0.1, num_kv_pages_per_block=1, num_queries_per_block=8
    )
    return out[:6]


def _ragged_paged_ref(q: Any, kv: Any, kv_lens: Any, pages: Any, cu: Any, num: Any) -> jax.Array:  # noqa: PLR0917 - the op's own positional arguments
    heads = q.shape[1]
    outs = []
    for s in range(int(num[0])):
        q_start, q_end, kv_len = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        cache = kv[pages[s]].reshape(-1, kv.shape[2], kv.shape[3])[:kv_len]  # [kv_len, 2*kv_heads, d]
        k = jnp.repeat(cache[:, 0::2], heads // (kv.shape[2] // 2), axis=1)
        v = jnp.repeat(cache[:, 1::2], heads // (kv.shape[2] // 2), axis=1)
        qs = q[q_start:q_end]
        logits = jnp.einsum("qhd,khd->hqk", qs, k, precision="highest") * 0.1
        q_pos = kv_len - (q_end - q_start) + jnp.arange(q_end - q_start)
        logits = jnp.where(q_pos[:, None] >= jnp.arange(kv_len)[None], logits, -jnp.inf)
        outs.append(jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, -1), v, precision="highest"))
    return jnp.concatenate(outs)


def _threefry_bits(m: Any, key: jax.Array) -> jax.Array:
    return m.threefry_2x32_count(key, (256, 256), (256, 256), (256, 256))


def _threefry_ref(key: jax.Array) -> jax.Array:
    # The kernel fuses a shaped iota with threefry_2x32: JAX's partitionable threefry bits.
    with jax.threefry_partitionable(True):
        return jax.random.bits(jax.random.wrap_key_data(key, impl="threefry2x32"), (256, 256), jnp.uint32)


def _philox_inputs() -> tuple[jax.Array, ...]:
    return (jnp.array([0, 42], jnp.uint32),)


def _philox(m: Any, key: jax.Array) -> jax.Array:
    return m.philox_4x32_count(key, (8, 256))


def _philox_ref(key: jax.Array) -> jax.Array:
    """The op's Philox-4x32 variant (10 rounds, hi words 0) over the flat counter, in numpy."""
    m = importlib.import_module(f"{OPS}.tpu.random.philox")
    mul_a, mul_b = np.uint64(m.MUL_A), np.uint64(m.MUL_B)
    bump_hi, bump_lo = np.uint32(m.K_HI_32), np.uint32(m.K_LO_32)
    k_hi, k_lo = np.uint32(key[0]), np.uint32(key[1])
    hi0, hi1, lo1 = (np.zeros(8 * 256, np.uint32) for _ in range(3))
    lo0 = np.arange(8 * 256, dtype=np.uint32)
    for i in range(10):
        a = mul_a * hi1.astype(np.uint64)
        b = mul_b * hi0.astype(np.uint64)
        hi0, lo0, hi1, lo1 = (
            (a >> np.uint64(32)).astype(np.uint32) ^ lo0 ^ k_hi,
            a.astype(np.uint32),
            (b >> np.uint64(32)).astype(np.uint32) ^ lo1 ^ k_lo,
            b.astype(np.uint32),
        )
        if i != 9:
            with np.errstate(over="ignore"):  # the key schedule wraps around 2**32 by design
                k_hi, k_lo = k_hi + bump_hi, k_lo + bump_lo
    return jnp.asarray((hi0 ^ lo0).reshape(8, 256))


def _philox_op_bug(m: Any) -> str | None:
    # jax <= 0.7.x: mul32_hi_lo returned the low half-words' product as the low word.
    _, lo = m.mul32_hi_lo(jnp.uint32(0x10001), jnp.uint32(0x10001))
    if int(lo) != 0x20001:
        return "this jax's philox op computes a wrong 32x32 multiply (mul32_hi_lo), fixed in later jax"
    return None


def _all_gather_inputs() -> tuple[jax.Array, ...]:
    return (jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(4 * 8, 128),)


def _all_gather(m: Any, x: jax.Array) -> jax.Array:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    return m.all_gather(x, mesh=mesh, axis_name="x")


# --- Mosaic-GPU kernels ---------------------------------------------------------------------------


def _ragged_dot_inputs() -> tuple[jax.Array, ...]:
    lhs = _rand(40, 256, 128, dtype=jnp.bfloat16)
    rhs = _rand(41, 2, 128, 128, dtype=jnp.bfloat16)
    return lhs, rhs, jnp.array([128, 128], jnp.int32)


def _ragged_dot(m: Any, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    return m.ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1
    )


def _ragged_dot_ref(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    out = _gmm_ref(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    return out.astype(jnp.bfloat16)


def _transposed_ragged_dot(m: Any, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    return m.transposed_ragged_dot(
        lhs, rhs, group_sizes=sizes, block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1
    )


def _transposed_inputs() -> tuple[jax.Array, ...]:
    return (
        _rand(42, 256, 128, dtype=jnp.bfloat16),
        _rand(43, 256, 128, dtype=jnp.bfloat16),
        jnp.array([128, 128], jnp.int32),
    )


def _transposed_ref(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    return _tgmm_ref(jnp.swapaxes(lhs, 0, 1).astype(jnp.float32), rhs.astype(jnp.float32), sizes).astype(jnp.bfloat16)


def _mgpu_attention_inputs() -> tuple[jax.Array, ...]:
    # [batch, seq, heads, d]
    return tuple(_rand(44 + i, 1, 128, 1, 64, dtype=jnp.float16) for i in range(3))


def _mgpu_attention(m: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    config = m.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    return m.attention(q, k, v, config)


def _mgpu_attention_ref(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    f = [jnp.swapaxes(t.astype(jnp.float32), 1, 2) for t in (q, k, v)]
    return jnp.swapaxes(_attention(*f, scale=1 / math.sqrt(q.shape[-1])), 1, 2).astype(q.dtype)


def _matmul_inputs(dtype: Any = jnp.float16) -> tuple[jax.Array, ...]:
    return _rand(50, 128, 128, dtype=dtype), _rand(51, 128, 128, dtype=dtype)


def _hopper_matmul(m: Any, a: jax.Array, b: jax.Array) -> jax.Array:
    config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    if len(inspect.signature(m.matmul).parameters) == 3:  # jax < 0.9: no bias operand
        return m.matmul(a, b, config)
    return m.matmul(a, b, None, config)


def _matmul_ref(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)).astype(a.dtype)


def _blackwell_matmul(m: Any, a: jax.Array, b: jax.Array) -> jax.Array:
    fields = {f.name for f in dataclasses.fields(m.TuningConfig)}
    extra = {"collective": False} if "collective" in fields else {}
    config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, **extra)
    return m.matmul_kernel(a, b, config)


# --- the corpus -----------------------------------------------------------------------------------


def _all() -> list[Case]:
    from pallas_guard._jax import pallas as jax_pallas

    no_gpu_interpreter = None if jax_pallas.gpu_params_class() is not None else NO_GPU_INTERPRETER
    triton = functools.partial(Case, family="triton")
    tpu = functools.partial(Case, family="mosaic_tpu")
    mgpu = functools.partial(Case, family="mosaic_gpu")
    return [
        triton(
            name="gpu.attention.mha",
            module="gpu.attention",
            inputs=_mha_inputs,
            call=_mha,
            reference=_mha_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.attention.mha_causal",
            module="gpu.attention",
            inputs=_mha_inputs,
            call=functools.partial(_mha, causal=True),
            reference=functools.partial(_mha_ref, causal=True),
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.attention.mha_grad",
            module="gpu.attention",
            inputs=_mha_inputs,
            call=lambda m, *a: _grads(functools.partial(_mha, m), *a),
            reference=lambda *a: _grads(_mha_ref, *a),
            rtol=1e-3,
            atol=1e-3,
        ),
        triton(
            name="gpu.decode_attention.mqa",
            module="gpu.decode_attention",
            inputs=_decode_inputs,
            call=lambda m, q, k, v: m.mqa(q, k, v, block_h=16, block_k=16, k_splits=4),
            reference=_mqa_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.decode_attention.gqa",
            module="gpu.decode_attention",
            inputs=_gqa_inputs,
            call=lambda m, q, k, v: m.gqa(q, k, v, block_h=16, block_k=16, k_splits=4),
            reference=_gqa_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.layer_norm",
            module="gpu.layer_norm",
            inputs=_norm_inputs,
            call=lambda m, x, w, b: m.layer_norm(x, w, b),
            reference=_layer_norm_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.layer_norm_grad",
            module="gpu.layer_norm",
            inputs=_norm_inputs,
            call=lambda m, *a: _grads(m.layer_norm, *a),
            reference=lambda *a: _grads(_layer_norm_ref, *a),
            rtol=1e-3,
            atol=1e-3,
        ),
        triton(
            name="gpu.rms_norm",
            module="gpu.rms_norm",
            inputs=_norm_inputs,
            call=lambda m, x, w, b: m.rms_norm(x, w, b),
            reference=_rms_norm_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        triton(
            name="gpu.rms_norm_grad",
            module="gpu.rms_norm",
            inputs=_norm_inputs,
            call=lambda m, *a: _grads(m.rms_norm, *a),
            reference=lambda *a: _grads(_rms_norm_ref, *a),
            rtol=1e-3,
            atol=1e-3,
        ),
        triton(
            name="gpu.softmax",
            module="gpu.softmax",
            inputs=lambda: (_rand(60, 8, 128),),
            call=lambda m, x: m.softmax(x),
            reference=lambda x: jax.nn.softmax(x, axis=-1),
            rtol=1e-5,
            atol=1e-6,
        ),
        triton(
            name="gpu.paged_attention",
            module="gpu.paged_attention",
            inputs=_paged_inputs,
            call=lambda m, q, k, v, t, n: m.paged_attention(q, k, v, t, n, pages_per_compute_block=2, k_splits=2),
            reference=_paged_ref,
            rtol=1e-4,
            atol=1e-4,
        ),
        tpu(
            name="tpu.example_kernel.double",
            module="tpu.example_kernel",
            inputs=lambda: (_rand(61, 8, 128),),
            call=lambda m, x: m.double(x),
            reference=lambda x: 2 * x,
        ),
        tpu(
            name="tpu.matmul",
            module="tpu.matmul",
            inputs=lambda: (_rand(62, 256, 256), _rand(63, 256, 256)),
            call=lambda m, x, y: m.matmul(x, y, block_shape=(128, 128), block_k=128),
            reference=lambda x, y: jnp.dot(x, y, precision="highest"),
            rtol=1e-4,
            atol=1e-3,
        ),
        tpu(
            name="tpu.flash_attention",
            module="tpu.flash_attention",
            inputs=_flash_inputs,
            call=_flash,
            reference=lambda q, k, v: _attention(q, k, v, causal=True, scale=0.125),
            rtol=1e-4,
            atol=1e-4,
        ),
        tpu(
            name="tpu.flash_attention_grad",
            module="tpu.flash_attention",
            inputs=_flash_inputs,
            call=lambda m, *a: _grads(functools.partial(_flash, m), *a),
            reference=lambda *a: _grads(functools.partial(_attention, causal=True, scale=0.125), *a),
            rtol=1e-3,
            atol=1e-3,
        ),
        tpu(
            name="tpu.megablox.gmm",
            module="tpu.megablox.gmm",
            inputs=_gmm_inputs,
            call=lambda m, lhs, rhs, sizes: m.gmm(lhs, rhs, sizes),
            reference=_gmm_ref,
            rtol=1e-4,
            atol=1e-3,
        ),
        tpu(
            name="tpu.megablox.tgmm",
            module="tpu.megablox.gmm",
            inputs=_tgmm_inputs,
            call=lambda m, lhs, rhs, sizes: m.tgmm(lhs, rhs, sizes),
            reference=_tgmm_ref,
            rtol=1e-4,
            atol=1e-3,
        ),
        tpu(
            name="tpu.megablox.gmm_grad",
            module="tpu.megablox.ops",
            inputs=_gmm_inputs,
            call=_gmm_grad,
            reference=_gmm_grad_ref,
            rtol=1e-3,
            atol=1e-2,
        ),
        tpu(
            name="tpu.paged_attention",
            module="tpu.paged_attention.paged_attention_kernel",
            inputs=_tpu_paged_inputs,
            call=_tpu_paged,
            reference=_tpu_paged_ref,
            # The kernel rounds its probabilities to bfloat16 before the second matmul.
            rtol=1e-2,
            atol=1e-2,
        ),
        tpu(
            name="tpu.ragged_paged_attention",
            module="tpu.ragged_paged_attention.kernel",
            inputs=_ragged_paged_inputs,
            call=_ragged_paged,
            reference=_ragged_paged_ref,
            rtol=1e-4,
            atol=1e-4,
            # A version gate, not a feature test: the failure is a bug inside the interpreters.
            xfail=RAGGED_PAGED if jax.__version_info__ >= (0, 10, 0) else None,
        ),
        tpu(
            name="tpu.splash_attention",
            module="tpu.splash_attention.splash_attention_kernel",
            inputs=_splash_inputs,
            call=_splash,
            reference=lambda q, k, v: _attention(q, k, v, causal=True),
            rtol=1e-4,
            atol=1e-4,
        ),
        tpu(
            name="tpu.random.threefry",
            module="tpu.random.threefry",
            inputs=lambda: (jnp.array([0, 42], jnp.uint32),),
            call=_threefry_bits,
            reference=_threefry_ref,
            rtol=0,
            atol=0,
        ),
        tpu(
            name="tpu.random.philox",
            module="tpu.random.philox",
            inputs=_philox_inputs,
            call=_philox,
            reference=_philox_ref,
            rtol=0,
            atol=0,
            skip=_philox_op_bug,
        ),
        tpu(
            name="tpu.all_gather",
            module="tpu.all_gather",
            inputs=_all_gather_inputs,
            call=_all_gather,
            reference=lambda x: x,
            rtol=0,
            atol=0,
            expected="tpu",
            devices=4,
        ),
        mgpu(
            name="gpu.ragged_dot_mgpu",
            module="gpu.ragged_dot_mgpu",
            inputs=_ragged_dot_inputs,
            call=_ragged_dot,
            reference=_ragged_dot_ref,
            rtol=2e-2,
            atol=2e-1,
            expected="gpu",
            # A version gate, not a feature test: the failure is a bug inside the interpreter.
            xfail=no_gpu_interpreter or (GPU_INTERPRETER_EFFECTS if jax.__version_info__ < (0, 10, 0) else None),
        ),
        mgpu(
            name="gpu.transposed_ragged_dot_mgpu",
            module="gpu.transposed_ragged_dot_mgpu",
            inputs=_transposed_inputs,
            call=_transposed_ragged_dot,
            reference=_transposed_ref,
            rtol=2e-2,
            atol=2e-1,
            expected="gpu",
            xfail=CORE_COUNT,
        ),
        mgpu(
            name="gpu.attention_mgpu",
            module="gpu.attention_mgpu",
            inputs=_mgpu_attention_inputs,
            call=_mgpu_attention,
            reference=_mgpu_attention_ref,
            rtol=2e-2,
            atol=2e-2,
            expected="gpu",
            xfail=CUDA_VERSIONS,
        ),
        mgpu(
            name="gpu.hopper_matmul_mgpu",
            module="gpu.hopper_matmul_mgpu",
            inputs=_matmul_inputs,
            call=_hopper_matmul,
            requires=("matmul", "TuningConfig"),
            reference=_matmul_ref,
            rtol=2e-2,
            atol=2e-1,
            expected="gpu",
            device="h100",
            xfail=HOPPER_CORE_COUNT if jax.__version_info__ < (0, 10, 0) else None,
        ),
        mgpu(
            name="gpu.blackwell_matmul_mgpu",
            module="gpu.blackwell_matmul_mgpu",
            inputs=_matmul_inputs,
            call=_blackwell_matmul,
            requires=("matmul_kernel", "TuningConfig"),
            reference=_matmul_ref,
            rtol=2e-2,
            atol=2e-1,
            expected="gpu",
            xfail=BLACKWELL,
        ),
    ]


def _available(case: Case) -> bool:
    try:
        module = case.op_module()
    except ImportError:  # an op this jax does not ship (or one needing a missing optional dep)
        return False
    return all(hasattr(module, attribute) for attribute in case.requires)


@functools.cache
def cases() -> tuple[Case, ...]:
    """The corpus for the installed jax: every case whose op this jax ships."""
    return tuple(case for case in _all() if _available(case))


def by_name(name: str) -> Case:
    return next(case for case in cases() if case.name == name)


def check(case: Case, result: Any) -> None:
    """Assert ``result`` matches the reference at the case's tolerances (any pytree)."""
    expected = case.expected_output()
    leaves, tree = jax.tree_util.tree_flatten(result)
    want, want_tree = jax.tree_util.tree_flatten(expected)
    assert tree == want_tree, f"{case.name}: output structure {tree} != reference {want_tree}"
    for got, ref in zip(leaves, want, strict=True):
        got_np = np.asarray(jnp.asarray(got, jnp.float32) if got.dtype != jnp.uint32 else got)
        ref_np = np.asarray(jnp.asarray(ref, jnp.float32) if ref.dtype != jnp.uint32 else ref)
        np.testing.assert_allclose(got_np, ref_np, rtol=case.rtol, atol=case.atol, err_msg=case.name)
