"""JAX's configuration and backends, all read without initialising a backend."""

from __future__ import annotations

import sys
from typing import Any

from pallas_guard._jax.lookup import import_optional

_config_holders: dict[str, Any] = {}  # read on every kernel call: found once, where found


def jax_config_value(name: str) -> Any:
    """A ``jax.config`` value as seen in this thread/context (scopes included); None if absent."""
    holder = _config_holders.get(name)
    if holder is None:
        config = import_optional("jax._src.config")
        holder = getattr(config, name.removeprefix("jax_"), None) if config is not None else None
        if holder is not None and hasattr(holder, "value"):
            _config_holders[name] = holder
    if holder is not None and hasattr(holder, "value"):
        return holder.value
    jax = sys.modules.get("jax")
    return getattr(getattr(jax, "config", None), name, None)


def interpret_mode_config() -> Any | None:
    """JAX's trace-time interpret switch (``pltpu.force_tpu_interpret_mode``), jax >= 0.7.0."""
    config = import_optional("jax._src.config")
    return getattr(config, "pallas_tpu_interpret_mode_context_manager", None)


def forced_interpret_value() -> Any:
    holder = interpret_mode_config()
    return None if holder is None else holder.value


def backends_initialized() -> bool:
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is None:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", None))


def default_backend() -> str | None:
    """``jax.default_backend()``, but only when calling it cannot initialise a backend."""
    if not backends_initialized():
        return None
    jax = sys.modules.get("jax")
    return None if jax is None else str(jax.default_backend())


def abstract_mesh_config() -> Any | None:
    """JAX's config state of the current abstract mesh (``get_global``/``set_global``/``value``),
    where jax is imported: ``jax._src.mesh`` from 0.12, ``jax._src.config`` before."""
    if "jax" not in sys.modules:
        return None
    for module_name in ("jax._src.mesh", "jax._src.config"):
        holder = getattr(import_optional(module_name), "abstract_mesh_context_manager", None)
        if holder is not None and hasattr(holder, "set_global"):
            return holder
    return None


def trace_context() -> Any:
    """JAX's key of the configuration a trace depends on (what ``jit`` keys its traces with); None
    where this jax has none."""
    config = import_optional("jax._src.config")
    function = getattr(config, "trace_context", None)
    if function is None:
        return None
    try:
        return function()
    except Exception:  # a changed internal: no key, so nothing is reused
        return None
