"""How Llama is split into pipeline stages and tensor-parallel shards, and which layouts fit.

The model is captured and sharded automatically (merak.shard); this file only holds the
recipe's data for it: the model's inputs, where ``layer_split`` cuts by default (before every
decoder layer), the TP plan and the layout checks.
"""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from merak.tensor_parallel import TPPlan, default_plan

from .model import build_model

INPUT_NAMES = ("input_ids",)
SPLIT_POINTS = ("model.layers.*",)

# Plans already made, by model option: resolving the settings and every worker ask for the same one.
_PLANS: dict[str, TPPlan] = {}


def tp_plan(model_cfg) -> TPPlan:
    """transformers' own tensor-parallel plan of LlamaForCausalLM, translated by merak.

    ``merak.tensor_parallel.default_plan`` reads the plan transformers ships with the model
    (``model.tp_plan``: query, key, value, gate and up projections column-parallel, output and
    down projections row-parallel, the LM head and embedding split by vocabulary with
    ``parallel_vocab``) from a copy built on the meta device (no memory). It has no
    sequence-parallel region, so ``trainer.sequence_parallel`` stays false for this model.
    """
    values = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    # merak asks for the plan once the values have the schema's types (merak.config.resolve_settings), but
    # before check_layout: sizes that cannot build are listed by check_layout and the run stops before any
    # worker starts; an empty plan keeps a second, misleading "no plan" message out of that list.
    if check_layout(model_cfg, 1, 1, 1):
        return TPPlan()
    key = json.dumps(values, sort_keys=True, default=str)
    if key not in _PLANS:
        with torch.device("meta"):
            model = build_model(model_cfg)
        _PLANS[key] = default_plan(model)
    return _PLANS[key]


def example_inputs(model_cfg, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A microbatch-shaped input for graph capture (token ids of ``seq_length``)."""
    return {"input_ids": torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long)}


def _divisors(value: int) -> str:
    """``value``'s divisors as a choice: "1, 2 or 4"."""
    found = [str(d) for d in range(1, value + 1) if value % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def check_layout(model_cfg, dp: int, tp: int, pp: int) -> list[str]:
    """Problems with running ``model_cfg`` at this layout (empty list when it fits); each names the fix.

    Each size is already a positive integer (schema.LlamaModel); these checks relate them.
    """
    problems = []
    heads, kv_heads = model_cfg.num_heads, model_cfg.num_kv_heads
    if model_cfg.hidden_size % heads:
        problems.append(f"model.hidden_size={model_cfg.hidden_size} is not divisible by model.num_heads={heads}")
    if heads % kv_heads:
        problems.append(f"model.num_heads={heads} is not divisible by model.num_kv_heads={kv_heads} "
                        "(each key-value head serves a whole group of query heads)")
    # Each tp rank keeps whole key-value heads (and the query heads of their groups).
    if kv_heads % tp:
        problems.append(f"model.num_kv_heads={kv_heads} is not divisible by parallel.tp={tp}: use parallel.tp="
                        f"{_divisors(kv_heads)}, or a model option with more key-value heads")
    if model_cfg.intermediate_size % tp:
        problems.append(f"model.intermediate_size={model_cfg.intermediate_size} is not divisible by "
                        f"parallel.tp={tp}: use a parallel.tp that divides it")
    return problems
