"""One kernel as an entry point built it: what the user passed, and what the guard learns of it.

Everything is computed on demand (most kernels never need their facts) and nothing is decided
here: the front door decides when the kernel is called, with the settings in force there.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import threading
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._deciding import facts as _facts
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._vocabulary.entry_points import PALLAS_CALL, EntryPoint


class Kernel:
    """A kernel built by ``entry`` with ``args``/``kwargs``; ``original`` is the unguarded entry point."""

    def __init__(
        self,
        entry: EntryPoint,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        decorated: Any = None,
    ) -> None:
        self.entry, self.original, self.args, self.kwargs = entry, original, args, kwargs
        self.decorated = decorated
        """The body a decorator form (``@pl.kernel(mesh=...)``, ``pl.core_map(mesh)``) was applied to."""
        self.lock = threading.Lock()
        self.variants: dict[Hashable, Any] = {}
        """(interpreter, its settings) -> this kernel built for it (the engine's, per kernel object)."""
        self.settled: dict[Hashable, tuple[str, tuple[str, ...]]] = {}
        """Argument shapes -> the interpreter verified for them, for kernels without an identity."""

    @property
    def body(self) -> Any:
        return self.decorated if self.decorated is not None else self.entry.body(self.args, self.kwargs)

    @functools.cached_property
    def grid(self) -> tuple[Any, ...] | None:
        """The grid it was built with; None where a mesh decides the steps (``pl.kernel``, ...)."""
        grid = self.kwargs.get("grid")
        if grid is None:
            grid = getattr(self.kwargs.get("grid_spec"), "grid", None)
        if grid is None and self.entry is PALLAS_CALL and self.kwargs.get("grid_spec") is None:
            return ()  # JAX's default: a pallas_call without a grid runs its body once
        return (grid,) if isinstance(grid, int) else tuple(grid) if grid is not None else None

    @functools.cached_property
    def info(self) -> _diagnostics.KernelInfo:
        if self.body is None:
            name = self.kwargs.get("name") or f"<{self.entry.label} body>"
            return _diagnostics.KernelInfo(str(name), None, self.entry.label)
        return _diagnostics.kernel_from_callable(self.body, entry_point=self.entry.label, name=self.kwargs.get("name"))

    @functools.cached_property
    def facts(self) -> _facts.KernelFacts:
        mesh = self.entry.mesh(self.args, self.kwargs)
        return _facts.kernel_facts(self.entry.label, self.body, self.kwargs, mesh=mesh)

    @functools.cached_property
    def identity(self) -> Hashable | None:
        """What determines this kernel's interpreter choice: the entry point, the body with its
        closure and partial values, the module globals its code reads (a flag that switches what
        the body traces), and every argument it was built with (grid, specs, shapes,
        ``compiler_params``). None when a part has no stable value (then choices are kept per
        kernel object only: an ``id()`` may be reused by another kernel)."""
        try:
            return (
                self.entry.label,
                fingerprint(self.body),
                fingerprint(_globals_read(self.body)),
                fingerprint(self.args),
                fingerprint(self.kwargs),
            )
        except _Unstable:
            return None

    def build(self, interpret: Any = None, *, marks: dict[str, str] | None = None) -> Any:
        """This kernel as the entry point builds it with ``interpret`` (its compiler_params adjusted
        for the interpreter; None: as the user built it); a decorator form is applied to its body
        (for ``core_map``: run). ``marks``: added to its ``metadata``, where the entry point takes one."""
        kwargs = dict(self.kwargs)
        if interpret is not None:
            kwargs["interpret"] = interpret
        if marks and _takes_metadata(self.original):
            kwargs["metadata"] = {**(kwargs.get("metadata") or {}), **marks}
        if jax_pallas.interpreter_of(interpret) == "tpu" and self.facts.family in ("triton", "mosaic_gpu"):
            # TPU interpret mode accepts only TPU compiler_params; these are hints for another compiler.
            kwargs["compiler_params"] = None
        built = self.original(*self.args, **kwargs)
        return built(self.decorated) if self.decorated is not None else built


def _globals_read(body: object) -> dict[str, object]:
    """The module globals the body's code, its nested functions and its module's helpers name."""
    namespace = getattr(_facts.innermost_function(body), "__globals__", None) or {}
    return {
        name: namespace[name]
        for code in _facts.code_objects(body, helpers=True)
        for name in code.co_names
        if name in namespace and not isinstance(namespace[name], types.ModuleType)
    }


@functools.lru_cache(maxsize=64)
def _takes_metadata(entry_point: Any) -> bool:
    try:
        return "metadata" in inspect.signature(entry_point).parameters
    except (TypeError, ValueError):
        return False


# --- identity --------------------------------------------------------------------------------------


class _Unstable(Exception):
    """A value with no stable fingerprint (its identity is all it has)."""


_MAX_DEPTH = 8
_MAX_ARRAY_ELEMENTS = 4096
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def fingerprint(value: object, depth: int = 0) -> Hashable:  # noqa: PLR0911, PLR0912 - one return per kind of value
    """A hashable value equal for equal kernels: functions by code, defaults and closure values;
    partials by function and arguments; containers and dataclasses by their parts; arrays by shape,
    dtype and (small ones) contents. Raises ``_Unstable`` for what only has an identity."""
    if depth > _MAX_DEPTH:
        raise _Unstable
    deeper = functools.partial(fingerprint, depth=depth + 1)
    if isinstance(value, (*_SCALARS, enum.Enum, type, types.CodeType)):
        return (type(value), value)
    if isinstance(value, functools.partial):
        return ("partial", deeper(value.func), deeper(value.args), deeper(value.keywords))
    if isinstance(value, types.FunctionType):
        cells = tuple(deeper(cell.cell_contents) for cell in value.__closure__ or ())
        defaults = (deeper(value.__defaults__), deeper(value.__kwdefaults__))
        return ("function", value.__code__, defaults, cells, deeper(getattr(value, "__wrapped__", None)))
    if isinstance(value, types.MethodType):
        return ("method", deeper(value.__func__), deeper(value.__self__))
    if isinstance(value, types.BuiltinFunctionType | types.ModuleType):
        return (type(value), getattr(value, "__module__", None), getattr(value, "__qualname__", value.__name__))
    if isinstance(value, tuple | list):
        return (type(value), tuple(deeper(item) for item in value))
    if isinstance(value, Mapping):
        return (type(value), tuple(sorted(((repr(k), deeper(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(deeper(getattr(value, field.name, None)) for field in dataclasses.fields(value))
        return (type(value), fields)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return _array_fingerprint(value, shape, dtype)
    wrapped = getattr(value, "__wrapped__", None)  # jitted functions, functools.wraps decorators
    if wrapped is not None:
        return ("wrapper", type(value), deeper(wrapped))
    if type(value).__hash__ is not object.__hash__ and type(value).__eq__ is not object.__eq__:
        try:
            hash(value)
        except TypeError:
            raise _Unstable from None
        return (type(value), value)
    raise _Unstable


def _array_fingerprint(value: Any, shape: tuple[Any, ...], dtype: Any) -> Hashable:
    """An array or abstract value: shape and dtype; a small concrete array also by its contents
    (kernels close over constant tables)."""
    size = 1
    for dimension in shape:
        size *= dimension if isinstance(dimension, int) else _MAX_ARRAY_ELEMENTS + 1
    if not hasattr(value, "__array__") or type(value).__name__ in {"ShapeDtypeStruct", "ShapedArray"}:
        return ("abstract", shape, str(dtype), str(getattr(value, "memory_space", "")))
    if size > _MAX_ARRAY_ELEMENTS:
        raise _Unstable
    try:
        import numpy as np

        contents = np.asarray(value).tobytes()
    except Exception as error:  # a tracer has no contents
        raise _Unstable from error
    return ("array", shape, str(dtype), contents)
