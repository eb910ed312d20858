"""The compiled extension and the start-up hook live here; all package metadata is in pyproject.toml."""

import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

# Python runs the import lines of every .pth file in site-packages at start-up: this one arms the
# torchvision fix (_merak_torchvision.py) so that transformers, timm and torchvision import in any
# order, before or without merak. Its name sorts after the editable install's own .pth, which makes
# _merak_torchvision importable from a checkout installed with `pip install -e`. The lookup first
# keeps a checkout deleted without uninstalling from printing an error at every Python start.
STARTUP_PTH = "merak-torchvision.pth"
STARTUP_LINE = ('import importlib.util; importlib.util.find_spec("_merak_torchvision") and '
                '__import__("_merak_torchvision").install_import_hook()\n')


class build_py_with_startup_hook(build_py):
    """build_py that also writes the start-up .pth to the root of the wheel (site-packages)."""

    def run(self):
        super().run()
        os.makedirs(self._startup_folder(), exist_ok=True)
        with open(os.path.join(self._startup_folder(), STARTUP_PTH), "w", encoding="utf-8") as handle:
            handle.write(STARTUP_LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self._startup_folder(), STARTUP_PTH)]

    def _startup_folder(self):
        # A regular wheel is made of build_lib. An editable one is not (the modules stay in the
        # checkout): files meant for site-packages go to the unpacked wheel, install's install_lib.
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib


setup(
    ext_modules=[Pybind11Extension("merak.shard._autopipe", ["merak/shard/_autopipe.cpp"], cxx_std=17, optional=True)],
    cmdclass={"build_ext": build_ext, "build_py": build_py_with_startup_hook},
)
