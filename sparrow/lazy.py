"""Package names that load on first use (PEP 562), so importing a package, or one of its light
submodules (errors, placement's settings, a command line's parser), does not import torch."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module-level __getattr__ for `package`: homes maps each exported name to the submodule
    (relative, without the dot) that defines it; the first use imports it and keeps the value."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{homes[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
