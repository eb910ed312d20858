"""Every recipe's model and data schemas (RecipeSpec.model_schema, data_schema): every shipped YAML of its
``model`` and ``data`` groups fits them, and a wrong value is named once, before the recipe's own checks
(check_layout, check_data) see it."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

from merak.config import ConfigError, resolve_settings
from merak.core.fields import typed_section

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("gpt", "bert", "t5", "llama", "vit", "swin", "wide_resnet")
GROUPS = ("model", "data")


def _spec(recipe: str):
    return importlib.import_module(f"recipes.{recipe}.spec").SPEC


def _shipped_yamls() -> list[tuple[str, str, Path]]:
    return [(recipe, group, path) for recipe in RECIPES for group in GROUPS
            for path in sorted((REPO / "recipes" / recipe / "conf" / group).glob("*.yaml"))]


SHIPPED = _shipped_yamls()


@pytest.mark.parametrize("recipe,group,path", SHIPPED,
                         ids=[f"{recipe}/{group}/{path.stem}" for recipe, group, path in SHIPPED])
def test_every_shipped_yaml_fits_its_schema(recipe, group, path):
    schema = getattr(_spec(recipe), f"{group}_schema")
    assert dataclasses.is_dataclass(schema), f"recipes/{recipe}/spec.py sets no {group}_schema"
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    problems: list[str] = []
    typed_section(values, schema, group, problems)
    assert problems == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_schema_fields_have_help(recipe):
    spec = _spec(recipe)
    for schema in (spec.model_schema, spec.data_schema):
        assert dataclasses.fields(schema), schema
        for field in dataclasses.fields(schema):
            assert field.metadata.get("help"), f"{schema.__qualname__}.{field.name} has no help"


def _compose(recipe: str, overrides):
    with hydra.initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        return hydra.compose("train", overrides=list(overrides))


class _Calls:
    """A recipe check that records its calls and finds nothing (the spec's functions are replaced by it)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *_args) -> list[str]:
        self.count += 1
        return []


def _problems_and_calls(recipe: str, overrides) -> tuple[list[str], _Calls, _Calls]:
    """resolve_settings' problems for the recipe's default config with ``overrides``, and the calls of
    its check_layout and check_data."""
    layout, data = _Calls(), _Calls()
    spec = dataclasses.replace(_spec(recipe), check_layout=layout, check_data=data)
    cfg = _compose(recipe, overrides)
    try:
        resolve_settings(spec, cfg)
    except ConfigError as error:
        return str(error).split("\n  - ")[1:], layout, data
    return [], layout, data


@pytest.mark.parametrize("recipe", RECIPES)
def test_defaults_reach_the_recipe_checks(recipe):
    problems, layout, data = _problems_and_calls(recipe, [])
    assert problems == [] and layout.count == 1 and data.count == 1


@pytest.mark.parametrize("recipe,override,expected", [
    ("gpt", "model.hidden_size=abc", "model.hidden_size='abc' must be an integer"),
    ("gpt", "model.num_heads=0", "model.num_heads=0 must be a positive integer"),
    ("gpt", "model.dropout=1.5", "model.dropout=1.5 must be within [0, 1)"),
    ("bert", "model.ffn_size=2.5", "model.ffn_size=2.5 must be an integer"),
    ("t5", "model.d_kv=-1", "model.d_kv=-1 must be a positive integer"),
    ("llama", "model.hidden_size=abc", "model.hidden_size='abc' must be an integer"),
    ("llama", "model.num_kv_heads=0", "model.num_kv_heads=0 must be a positive integer"),
    ("llama", "model.rope_scaling=abc", "model.rope_scaling='abc' must be a mapping"),
    ("vit", "model.patch_size=abc", "model.patch_size='abc' must be an integer"),
    ("vit", "model.timm_name=3", "model.timm_name=3 must be a string or null"),
    ("swin", "model.depths=[1,0,2]", "model.depths=[1, 0, 2] must be a list of positive integers"),
    ("swin", "model.num_heads=4", "model.num_heads=4 must be a list of integers"),
    ("wide_resnet", "model.width_per_group=0", "model.width_per_group=0 must be a positive integer"),
    ("wide_resnet", "model.layers=[3,0,6,3]", "model.layers=[3, 0, 6, 3] must be positive block counts"),
])
def test_a_wrong_model_value_is_named_once_and_check_layout_is_not_reached(recipe, override, expected):
    problems, layout, data = _problems_and_calls(recipe, [override])
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems[0]
    assert layout.count == 0 and data.count == 1


@pytest.mark.parametrize("recipe,override,expected", [
    ("gpt", "data.files=a.txt", "data.files='a.txt' must be a list of strings or null"),
    ("bert", "data.seed=1.5", "data.seed=1.5 must be an integer"),
    ("bert", "data.mask_prob=0", "data.mask_prob=0 must be in (0, 1]"),
    ("t5", "data.noise_density=1", "data.noise_density=1 must be in (0, 1)"),
    ("t5", "data.tokenizer_chars=0", "data.tokenizer_chars=0 must be a positive integer or null (all the text)"),
    ("llama", "data.tokenizer=3", "data.tokenizer=3 must be a string"),
    ("vit", "data.num_samples=0", "data.num_samples=0 must be a positive integer"),
    ("swin", "data.noise=-1", "data.noise=-1 must be a number >= 0"),
    ("wide_resnet", "data.seed=abc", "data.seed='abc' must be an integer"),
])
def test_a_wrong_data_value_is_named_once_and_check_data_is_not_reached(recipe, override, expected):
    problems, layout, data = _problems_and_calls(recipe, [override])
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems[0]
    assert layout.count == 1 and data.count == 0


def test_an_unknown_key_is_named_with_the_closest_field():
    problems, layout, _ = _problems_and_calls("gpt", ["+model.hiden_size=64"])
    assert len(problems) == 1 and problems[0].startswith(
        "model.hiden_size is not a known setting (did you mean model.hidden_size?)"), problems
    assert layout.count == 0


def test_the_real_check_layout_still_relates_values():
    """Values of the right types reach the recipe's own checks, which relate them to each other and to the layout."""
    cfg = _compose("gpt", ["model.num_heads=3"])
    with pytest.raises(ConfigError) as error:
        resolve_settings(_spec("gpt"), cfg)
    message = str(error.value)
    assert "model.hidden_size=128 is not divisible by model.num_heads=3" in message
    assert "model.num_heads=3 is not divisible by parallel.tp=2" in message
