"""A minimal post-import hook: run a callback right after a named module is imported.

wrapt's ``register_post_import_hook`` would do, but ``import wrapt`` costs ~100 ms (it pulls in
asyncio and importlib.metadata), more than Python's own start-up, and ``import pallas_guard``
must stay cheap. This finder is a few dozen lines and imports nothing.
"""

from __future__ import annotations

import _thread
import sys

# Only the type checker needs these (see pallas_guard/__init__.py): this module loads at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]


class _CallbackLoader:
    """Delegates to the real loader, then runs the callbacks once the module has executed."""

    def __init__(self, loader: Any, name: str, finder: PostImportFinder) -> None:
        self._loader = loader
        self._name = name
        self._finder = finder

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back, so the module looks as if no hook had been there.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._finder.fire(self._name, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder:
    """A ``sys.meta_path`` entry that only wraps the loader of the modules it watches."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callback]] = {}
        self._lock = _thread.allocate_lock()  # threading's Lock; `import threading` costs more

    def register(self, name: str, callback: Callback) -> None:
        """Run ``callback(module)`` after ``name`` is imported; at once if it already is."""
        with self._lock:
            callbacks = self._callbacks.setdefault(name, [])
            if callback not in callbacks:
                callbacks.append(callback)
        module = sys.modules.get(name)
        if module is not None:
            callback(module)

    def fire(self, name: str, module: ModuleType) -> None:
        with self._lock:
            callbacks = list(self._callbacks.get(name, ()))
        # Outside the lock, as wrapt does, so a callback that imports cannot deadlock.
        for callback in callbacks:
            callback(module)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in self._callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallbackLoader(spec.loader, fullname, self)  # type: ignore[assignment]
                return spec
        return None

    def invalidate_caches(self) -> None:
        """Nothing cached; present because importlib.invalidate_caches() calls it on every finder."""


_finder_lock = _thread.allocate_lock()


def finder() -> PostImportFinder:
    """The one finder of this process, kept across ``importlib.reload(pallas_guard)``."""
    with _finder_lock:
        for entry in sys.meta_path:
            if type(entry).__name__ == "PostImportFinder" and type(entry).__module__ == __name__:
                return entry  # type: ignore[return-value]
        created = PostImportFinder()
        sys.meta_path.insert(0, created)
        return created
