"""A meta path finder that runs a callback right after one module has executed: how the take point
wraps torch's modules before anything else reads their names, without importing torch itself."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["AfterImport"]


class AfterImport(importlib.abc.MetaPathFinder):
    """Once `name` is imported: its loader runs, then `on_loaded(module)`; an exception from it goes
    to `on_failed(exc)` (torch's internals moved: the module stays as torch makes it). The finder
    removes itself at that first import."""

    def __init__(self, name: str, on_loaded: Callable[[Any], None], on_failed: Callable[[Exception], None]) -> None:
        self.name, self.on_loaded, self.on_failed = name, on_loaded, on_failed

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, finder = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def __getattr__(self, name: str) -> Any:  # get_code, is_package...: what runpy's -m asks
                return getattr(loader, name)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                try:
                    finder.on_loaded(module)
                except Exception as e:
                    finder.on_failed(e)

        spec.loader = _Loader()
        return spec
