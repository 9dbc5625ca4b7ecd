"""Source locations: which frames are the guard's, and the user's line of an equation or an access."""

from __future__ import annotations

import os
import sys
from typing import Any

from pallas_guard._jax.lookup import import_optional

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The package's own directory: its frames are the guard's, in every layer."""


_frames_excluded = False


def exclude_guard_frames_from_jax_tracebacks() -> None:
    """Make JAX treat pallas_guard's frames as internal, in its user-frame search and tracebacks."""
    global _frames_excluded  # noqa: PLW0603
    # Once per process: each call appends to JAX's list again and clears its is_user_filename
    # cache, which every traced operation consults; install()/uninstall() cycles would pay that.
    if _frames_excluded:
        return
    source_info = import_optional("jax._src.source_info_util")
    register = getattr(source_info, "register_exclusion", None)
    if register is not None:
        register(PACKAGE_DIR)
        _frames_excluded = True


def current_traceback() -> Any | None:
    """The traceback JAX has set as the current source-info context (the equation being lowered or
    discharged), or None."""
    source_info = sys.modules.get("jax._src.source_info_util")
    current = getattr(source_info, "current", None)
    return getattr(current(), "traceback", None) if current is not None else None


def lowering_frames(ctx: Any) -> list[tuple[str, int]]:
    """``(file, line)`` of the non-jax frames of the equation being lowered, innermost first.

    The rule context carries its traceback on the inline path; on the cached path JAX leaves it
    None but sets the equation's traceback as the current source-info context.
    """
    source_info = import_optional("jax._src.source_info_util")
    traceback = getattr(ctx, "traceback", None) or current_traceback()
    if source_info is None or traceback is None:
        return []
    frames = getattr(source_info, "user_frames", None)
    if frames is not None:
        return [(frame.file_name, frame.start_line) for frame in frames(traceback)]
    find = getattr(source_info, "user_frame", None)
    frame = find(traceback) if find is not None else None
    return [] if frame is None else [(frame.file_name, frame.start_line)]


def access_site(eqn: Any = None) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the kernel code that made the access being discharged (or
    equation ``eqn``): the innermost frame outside jax's internals and the guard (JAX's own kernels
    count: they live outside ``jax/_src``)."""
    traceback = current_traceback() if eqn is None else getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is None:
        return None
    internal = (f"{os.sep}jax{os.sep}_src{os.sep}", PACKAGE_DIR + os.sep, "<frozen")
    for frame in getattr(traceback, "frames", ()):
        filename = str(getattr(frame, "file_name", ""))
        if filename and not any(part in filename for part in internal):
            line = getattr(frame, "line_num", None) or getattr(frame, "start_line", 0)
            return filename, int(line or 0), str(getattr(frame, "function_name", ""))
    return None
