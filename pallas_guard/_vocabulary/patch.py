"""The one patching primitive: a module (or class) attribute replaced by a wrapper, put back exactly.

A low module of its own: the installer patches JAX's entry points with it, and the interpreter
transforms (the bounds check, the guard's plain interpretation) wrap the plain interpreter's module
functions with it, without knowing the installation.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any


class Patch:
    """One module or class attribute replaced by a wrapper, and the exact object to put back."""

    def __init__(self, owner: ModuleType | type, attribute: str, original: Any, wrapper: Any) -> None:
        self.owner, self.attribute, self.original, self.wrapper = owner, attribute, original, wrapper

    def restore(self) -> None:
        if vars(self.owner).get(self.attribute) is self.wrapper:  # leave a user's own replacement
            setattr(self.owner, self.attribute, self.original)


def wrap(
    owner: ModuleType | type | None,
    attribute: str,
    make_wrapper: Callable[[Any], Any],
    hooks: list[Any],
    *,
    is_ours: Callable[[Any], bool],
    usable: Callable[[Any], bool] = callable,
) -> None:
    """Replace ``owner.attribute`` (its own, not inherited) by ``make_wrapper(it)``, unless it is
    missing, not ``usable`` (callable) or already ours; the entry added to ``hooks`` puts it back."""
    if owner is None:
        return
    original = vars(owner).get(attribute)
    if original is None or not usable(original) or is_ours(original):
        return
    wrapper = make_wrapper(original)
    setattr(owner, attribute, wrapper)
    hooks.append(Patch(owner, attribute, original, wrapper))
