"""``import verl...`` served by ``scaletrain.compat.verl...``: for running verl-written code unedited.

``install()`` puts a finder on ``sys.meta_path`` that answers every ``verl`` / ``verl.x.y`` import with the module
of the same path under ``scaletrain.compat.verl`` (the same module object, so ``mock.patch("verl.x.f")`` patches
what the code calls). ``make test-verl`` installs it in every process of its run (a ``sitecustomize``), Ray's
workers included; the project itself never imports ``verl``. It imports nothing heavy until a ``verl`` import
arrives.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

SOURCE = "verl"
TARGET = "scaletrain.compat.verl"


class _ExistingModule(importlib.abc.Loader):
    """Hands back an already-imported module under a second name, keeping its own ``__spec__``."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.own_spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.own_spec  # the import machinery set the alias's spec on it


class VerlAliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != SOURCE and not fullname.startswith(SOURCE + "."):
            return None
        try:
            module = importlib.import_module(TARGET + fullname[len(SOURCE) :])
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.startswith(TARGET):
                return None  # a verl module with no counterpart: a plain "No module named 'verl.x'"
            raise
        is_package = hasattr(module, "__path__")
        return importlib.machinery.ModuleSpec(fullname, _ExistingModule(module), is_package=is_package)


def install() -> None:
    if not any(isinstance(f, VerlAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, VerlAliasFinder())
