"""merak.recipe.load_spec: a train.py imports the spec of its own directory, wherever the directory is."""

from __future__ import annotations

import importlib
import pickle
import shutil
from pathlib import Path

import pytest

from merak.recipe import load_spec, recipe_package

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("gpt", "bert", "t5", "vit", "swin", "wide_resnet", "llama")


@pytest.mark.parametrize("recipe", RECIPES)
def test_repository_recipes_load_as_their_own_package(recipe):
    """In this repository the spec is the module tests import (recipes.<name>.spec), not a second copy."""
    spec = load_spec(REPO / "recipes" / recipe / "train.py")
    assert spec is importlib.import_module(f"recipes.{recipe}.spec").SPEC
    assert spec.name == recipe
    assert spec.build_model.__module__ == f"recipes.{recipe}.model"


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_py_imports_no_other_recipe(recipe):
    """Every recipe's train.py and spec.py reach their own files through their directory, so a copy does too."""
    for name in ("train.py", "spec.py", "parallel.py"):
        text = (REPO / "recipes" / recipe / name).read_text()
        assert f"recipes.{recipe}" not in text, f"recipes/{recipe}/{name} imports its own package absolutely"


def test_copy_outside_a_package_gets_its_own_name(tmp_path):
    copy = tmp_path / "gpt"  # the same directory name as the original: still its own package
    shutil.copytree(REPO / "recipes" / "gpt", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "model.py").write_text((copy / "model.py").read_text() + "\nCOPY_MARKER = True\n")
    spec = load_spec(copy / "train.py")
    package = recipe_package(copy)
    assert package != "recipes.gpt" and package.startswith("_merak_recipe_gpt_")
    assert spec.build_model.__module__ == f"{package}.model"
    assert importlib.import_module(f"{package}.model").COPY_MARKER
    assert load_spec(copy / "train.py") is spec  # loaded once, under a name that depends on the path only
    # Workers receive the spec pickled: its functions travel by reference to the copy's modules.
    assert pickle.loads(pickle.dumps(spec)).build_model is spec.build_model


def test_directory_without_a_spec_or_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="no spec.py"):
        load_spec(tmp_path / "train.py")
    (tmp_path / "spec.py").write_text("SPEC = None\n")
    with pytest.raises(FileNotFoundError, match="needs an __init__.py"):
        load_spec(tmp_path / "train.py")
    (tmp_path / "__init__.py").write_text("")
    with pytest.raises(TypeError, match="defines no SPEC"):
        load_spec(tmp_path / "train.py")
