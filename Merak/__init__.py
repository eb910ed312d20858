"""``import Merak``: the package name the original Merak documents use, for the same API as ``merak``.

``Merak`` is not a copy: importing it yields the ``merak`` module object itself, so
``Merak.init``, ``Merak.MerakArguments`` and ``Merak.MerakTrainer`` are merak's (and the trainer
API is still imported only when first used). ``import Merak.<sub>`` gives ``merak.<sub>``, the
same module object, so no state (the parallel groups, for one) exists twice.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import merak

_ALIAS = __name__  # "Merak"
_TARGET = merak.__name__  # "merak"


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``Merak.<sub>`` to the module ``merak.<sub>``.

    Without it, Python would find ``Merak.<sub>`` through ``merak.__path__`` and execute the
    file a second time as a different module.
    """

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder module; exec_module swaps in the real one

    def exec_module(self, module):
        real = importlib.import_module(_TARGET + module.__name__[len(_ALIAS):])
        # The import system returns whatever sys.modules holds for the name after exec_module,
        # so the placeholder is dropped and the real module is left untouched (its __spec__ too).
        sys.modules[module.__name__] = real


if not any(isinstance(finder, _SubmoduleAlias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleAlias())
sys.modules[_ALIAS] = merak
