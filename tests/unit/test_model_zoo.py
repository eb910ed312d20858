"""The recipe model zoo: every recipes/<r>/conf/model/*.yaml composes, validates, builds on the meta device and
has the documented number of parameters and recommended global batch size.

Parameter counts are ``sum(p.numel() for p in model.parameters())`` (tied weights once) in millions, rounded
to 0.01 M as the reference tables are. Sources of the expected numbers:

* seeds: the Merak-Zeus model table (ml-energy/merak-zeus, examples/README.md: "model name | parameter count |
  global batch size") for bert-*-uncased, gpt3-*, wide-resnet*; it builds GPT-3 as ``GPT2Config.from_pretrained
  ("gpt2")`` with the paper's widths (so vocab 50257 and n_positions 1024) and Wide ResNets as torchvision
  ``ResNet(Bottleneck, [3, 4, 6, 3] or [3, 4, 23, 3], width_per_group=64 * k)``.
* HF: the model built from the public Hugging Face config of that name (gpt2*, t5-*, google/vit-*,
  microsoft/swin-*, meta-llama/Llama-3.*), whose counts are the well-known ones (e.g. gpt2 124,439,808;
  t5-base 222,903,552).
* timm: ``timm.create_model(name)`` with its default sizes (vit_base_patch16_224 86.57 M, ...).
* repo: this repository's own demo and toy sizes.

BERT is the one place where the seeds cannot be reproduced by any faithful BERT: their 109.43 / 334.95 M come
from Merak's proxy ``nn.Linear`` (``LinearProxy``), which registered a bias only when one was passed as a third
argument, so every ``nn.Linear(in, out)`` of BertForMaskedLM (q, k, v, attention output, both FFN layers, the MLM
transform) lost its bias in their count. The real BertForMaskedLM has 109.51 / 335.17 M;
``test_bert_differs_from_the_seeds_by_the_biases_merak_proxies_dropped`` pins that explanation down.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import merak  # noqa: F401  (before transformers/torchvision/timm)

REPO = Path(__file__).resolve().parents[2]

# recipe -> option -> (parameters in M rounded to 0.01, recommended global batch size).
EXPECTED = {
    "gpt": {
        "demo": (7.24, 32),             # repo
        "toy": (1.66, 16),              # repo
        "gpt2": (124.44, 512),          # HF openai-community/gpt2 (124,439,808); batch 512: GPT-2 paper
        "gpt2-medium": (354.82, 512),   # HF openai-community/gpt2-medium (354,823,168)
        "gpt2-large": (774.03, 512),    # HF openai-community/gpt2-large (774,030,080)
        "gpt2-xl": (1557.61, 512),      # HF openai-community/gpt2-xl (1,557,611,200)
        "gpt3-small": (124.44, 512),    # seeds
        "gpt3-medium": (354.82, 512),   # seeds
        "gpt3-large": (758.73, 512),    # seeds
        "gpt3-xl": (1313.63, 1024),     # seeds
        "gpt3-2.7b": (2648.93, 1024),   # seeds
        "gpt3-6.7b": (6654.21, 2048),   # seeds
        "gpt3-13b": (12848.14, 2048),   # seeds
        "gpt3-175b": (174591.68, 3200),  # seeds (n_positions 1024; 2048 positions would give 174604.26)
    },
    "bert": {
        "toy": (0.21, 16),                    # repo
        "bert-base": (109.51, 256),           # alias of bert-base-uncased kept under its older name
        "bert-base-uncased": (109.51, 256),   # HF google-bert/bert-base-uncased as BertForMaskedLM; seeds 109.43
        "bert-large-uncased": (335.17, 256),  # HF google-bert/bert-large-uncased as BertForMaskedLM; seeds 334.95
    },
    "t5": {
        "toy": (0.23, 16),          # repo
        "t5-small": (60.51, 128),   # HF google-t5/t5-small (60,506,624); batch 128: T5 paper
        "t5-base": (222.90, 128),   # HF google-t5/t5-base (222,903,552)
        "t5-large": (737.67, 128),  # HF google-t5/t5-large (737,668,096)
    },
    "vit": {
        "toy": (0.15, 16),                # repo
        "timm-toy": (0.15, 16),           # repo
        "vit-base": (86.57, 4096),        # HF google/vit-base-patch16-224 (86,567,656); batch 4096: ViT paper
        "vit-large": (304.33, 4096),      # HF google/vit-large-patch16-224 (304,326,632)
        "timm-vit-tiny": (5.72, 1024),    # timm vit_tiny_patch16_224 (5,717,416); batch 1024: DeiT paper
        "timm-vit-base": (86.57, 4096),   # timm vit_base_patch16_224
        "timm-vit-large": (304.33, 4096),  # timm vit_large_patch16_224
    },
    "swin": {
        "toy": (0.35, 16),                 # repo
        "timm-toy": (0.35, 16),            # repo
        "swin-tiny": (28.29, 1024),        # HF microsoft/swin-tiny-patch4-window7-224 (28,288,354); batch: Swin paper
        "swin-base": (87.77, 1024),        # HF microsoft/swin-base-patch4-window7-224 (87,768,224)
        "swin-large": (196.53, 1024),      # HF microsoft/swin-large-patch4-window7-224 (196,532,476)
        "timm-swin-tiny": (28.29, 1024),   # timm swin_tiny_patch4_window7_224
        "timm-swin-base": (87.77, 1024),   # timm swin_base_patch4_window7_224
        "timm-swin-large": (196.53, 1024),  # timm swin_large_patch4_window7_224
    },
    "llama": {
        "toy": (1.63, 16),                # repo
        "llama-3.2-1b": (1235.81, 512),   # HF meta-llama/Llama-3.2-1B (1,235,814,400)
        "llama-3.2-3b": (3212.75, 512),   # HF meta-llama/Llama-3.2-3B (3,212,749,824)
        "llama-3.1-8b": (8030.26, 512),   # HF meta-llama/Llama-3.1-8B (8,030,261,248)
    },
    "wide_resnet": {
        "toy": (19.53, 16),                 # repo
        "wide_resnet50_2": (68.88, 1536),   # torchvision wide_resnet50_2, the same model as wide-resnet50_2
        "wide-resnet50_2": (68.88, 1536),   # seeds
        "wide-resnet50_4": (223.44, 1536),  # seeds
        "wide-resnet50_8": (804.16, 1536),  # seeds
        "wide-resnet101_2": (126.89, 1536),  # seeds
        "wide-resnet101_4": (419.63, 1536),  # seeds
        "wide-resnet101_8": (1517.37, 1536),  # seeds
    },
}

# The options the model zoo promises (a deleted yaml must fail here).
REQUIRED = {
    "gpt": ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl",
            "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"],
    "bert": ["bert-base-uncased", "bert-large-uncased"],
    "t5": ["t5-small", "t5-base", "t5-large"],
    "llama": ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"],
    "vit": ["vit-base", "vit-large", "timm-vit-base", "timm-vit-large"],
    "swin": ["swin-base", "swin-large", "timm-swin-base", "timm-swin-large"],
    "wide_resnet": ["wide-resnet50_2", "wide-resnet50_4", "wide-resnet50_8", "wide-resnet101_2",
                    "wide-resnet101_4", "wide-resnet101_8"],
}

# The seeds' table (M parameters, global batch), the reference the zoo reproduces.
SEEDS = {
    "bert-base-uncased": (109.43, 256), "bert-large-uncased": (334.95, 256),
    "gpt3-small": (124.44, 512), "gpt3-medium": (354.82, 512), "gpt3-large": (758.73, 512),
    "gpt3-xl": (1313.63, 1024), "gpt3-2.7b": (2648.93, 1024), "gpt3-6.7b": (6654.21, 2048),
    "gpt3-13b": (12848.14, 2048), "gpt3-175b": (174591.68, 3200),
    "wide-resnet50_2": (68.88, 1536), "wide-resnet50_4": (223.44, 1536), "wide-resnet50_8": (804.16, 1536),
    "wide-resnet101_2": (126.89, 1536), "wide-resnet101_4": (419.63, 1536), "wide-resnet101_8": (1517.37, 1536),
}

# Options whose sizes do not fit the recipe's default layout: gpt2-xl has 25 heads, train.yaml's tp is 2.
LAYOUT = {("gpt", "gpt2-xl"): ["parallel.tp=1"]}


def _shipped(recipe: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "recipes" / recipe / "conf" / "model").glob("*.yaml"))


def _compose(recipe: str, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def _spec(recipe: str):
    return importlib.import_module(f"recipes.{recipe}.spec").SPEC


def _hundredths_of_millions(model: torch.nn.Module) -> int:
    """The parameter count in units of 0.01 M: the precision of the tables above."""
    return round(sum(p.numel() for p in model.parameters()) / 1e4)


CASES = sorted({(r, o) for r, options in EXPECTED.items() for o in options}
               | {(r, o) for r in EXPECTED for o in _shipped(r)})


@pytest.mark.parametrize("recipe", sorted(REQUIRED))
def test_every_zoo_option_is_shipped(recipe):
    missing = sorted(set(REQUIRED[recipe]) - set(_shipped(recipe)))
    assert not missing, f"recipes/{recipe}/conf/model/ lacks {missing}"
    assert set(REQUIRED[recipe]) <= set(EXPECTED[recipe])


@pytest.mark.parametrize("recipe,option", CASES, ids=[f"{r}/{o}" for r, o in CASES])
def test_option_builds_on_meta_with_its_documented_size(recipe, option):
    from merak.config import resolve_settings

    path = REPO / "recipes" / recipe / "conf" / "model" / f"{option}.yaml"
    assert path.is_file(), f"{path.relative_to(REPO)} is missing"
    assert option in EXPECTED[recipe], f"{path.relative_to(REPO)}: add its expected size to EXPECTED"
    assert path.read_text().startswith("#"), f"{path.relative_to(REPO)} must open with a comment saying what it is"
    params, global_batch = EXPECTED[recipe][option]

    cfg = _compose(recipe, [f"model={option}", *LAYOUT.get((recipe, option), [])])
    spec = _spec(recipe)
    settings = resolve_settings(spec, cfg, world_size=None)
    assert settings.model_cfg.name == option
    assert cfg.model.global_batch_size == global_batch
    with torch.device("meta"):
        model = spec.build_model(cfg.model)
    assert all(p.is_meta for p in model.parameters())
    assert _hundredths_of_millions(model) == round(params * 100), (recipe, option)


@pytest.mark.parametrize("option", sorted(SEEDS))
def test_zoo_matches_the_seeds_table(option):
    recipe = "bert" if option.startswith("bert") else "gpt" if option.startswith("gpt") else "wide_resnet"
    params, global_batch = EXPECTED[recipe][option]
    seed_params, seed_batch = SEEDS[option]
    assert global_batch == seed_batch
    if recipe != "bert":  # see the module docstring and the test below
        assert params == seed_params


def test_bert_differs_from_the_seeds_by_the_biases_merak_proxies_dropped():
    """The seeds' BERT counts = our BertForMaskedLM minus the bias of every nn.Linear but the (tied) decoder."""
    for option in ("bert-base-uncased", "bert-large-uncased"):
        cfg = _compose("bert", [f"model={option}"])
        with torch.device("meta"):
            model = _spec("bert").build_model(cfg.model)
        total = sum(p.numel() for p in model.parameters())
        dropped = sum(m.bias.numel() for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and m.bias is not None and not name.endswith("decoder"))
        assert round((total - dropped) / 1e6, 2) == SEEDS[option][0]
        assert round(total / 1e6, 2) == EXPECTED["bert"][option][0]


@pytest.mark.parametrize("recipe,option", [("gpt", "toy"), ("bert", "toy"), ("t5", "toy"), ("vit", "timm-toy"),
                                           ("swin", "toy"), ("wide_resnet", "toy")])
def test_meta_and_cpu_builds_agree(recipe, option):
    cfg = _compose(recipe, [f"model={option}"])
    spec = _spec(recipe)
    with torch.device("meta"):
        on_meta = spec.build_model(cfg.model)
    on_cpu = spec.build_model(cfg.model)
    assert [(n, p.shape) for n, p in on_meta.named_parameters()] == \
        [(n, p.shape) for n, p in on_cpu.named_parameters()]
