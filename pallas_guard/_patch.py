"""The one patching primitive: a module (or class) attribute replaced by a wrapper, put back exactly.

A low module of its own: the installer patches JAX's entry points with it, and the interpreter
transforms (the bounds check, the guard's plain interpretation) wrap the plain interpreter's module
functions with it, without knowing the installation.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


class Patch:
    """One module or class attribute replaced by a wrapper, and the exact object to put back."""

    def __init__(self, owner: ModuleType | type, attribute: str, original: Any, wrapper: Any) -> None:
        self.owner, self.attribute, self.original, self.wrapper = owner, attribute, original, wrapper

    def restore(self) -> None:
        if vars(self.owner).get(self.attribute) is self.wrapper:  # leave a user's own replacement
            setattr(self.owner, self.attribute, self.original)
