"""Only the compiled extension lives here; all package metadata is in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[Pybind11Extension("merak.shard._autopipe", ["merak/shard/_autopipe.cpp"], cxx_std=17, optional=True)],
    cmdclass={"build_ext": build_ext},
)
