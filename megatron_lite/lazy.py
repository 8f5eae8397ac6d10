"""Package exports loaded on first use (PEP 562 module `__getattr__`), so importing a package
for its light names (config validation reads them in every CLI process) does not load its
heavy modules (DTensor, FSDP2, the kernels)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package` that imports `exports[name]` (a submodule's name) on first
    use of `name` and keeps the value in the package's namespace."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
