"""Merak's own TP plans for the Hugging Face model families its recipes train.

GPT-2, BERT, T5, ViT and Swin as transformers builds them. A rule that matches
no module is an error, so each builder takes where the family's base model sits
(``base``: ``"transformer"`` in GPT2LMHeadModel, ``""`` in GPT2Model) and which
output head exists; the defaults are the recipes' models. :func:`family_plan`
picks the builder and its arguments from a model instance (its config's
``model_type``). The plans of other libraries' models (timm, torchvision) are in
:mod:`merak.tensor_parallel.model_plans`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from merak.tensor_parallel.plan import TPPlan
from merak.tensor_parallel.sequence import SequenceParallelPlan


def _at(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def _vision_block_styles(block: str) -> dict[str, str]:
    """Transformers' ViT and Swin blocks share their layer names: q/k/v and fc1 by output features,
    o_proj and fc2 by input features."""
    return {f"{block}.attention.q_proj": "column", f"{block}.attention.k_proj": "column",
            f"{block}.attention.v_proj": "column", f"{block}.attention.o_proj": "row",
            f"{block}.mlp.fc1": "column", f"{block}.mlp.fc2": "row"}


def gpt2_plan(base: str = "transformer", lm_head: str | None = "lm_head") -> TPPlan:
    """GPT-2: Megatron's split of every block.

    The fused query/key/value projection and the first MLP layer by output features (each
    rank keeps num_heads / tp heads), the two output projections by input features. With
    parallel_vocab the tied embedding and LM head are split by vocabulary. With
    sequence_parallel the activations between the attention and MLP blocks (layer norms,
    residuals, dropout) hold seq_length / tp positions per rank.
    """
    block = _at(base, "h.*")
    return TPPlan(
        styles={f"{block}.attn.c_attn": "column", f"{block}.attn.c_proj": "row",
                f"{block}.mlp.c_fc": "column", f"{block}.mlp.c_proj": "row"},
        fused={f"{block}.attn.c_attn": 3},
        attributes={f"{block}.attn": ("num_heads", "split_size")},
        vocab={_at(base, "wte"): "vocab", lm_head: "column"} if lm_head else {},
        sequence=SequenceParallelPlan(enter=(_at(base, "drop"),), regions=(f"{block}.attn", f"{block}.mlp"),
                                      exit=(_at(base, "ln_f"),), sharded=(block,)),
        blocks=(block,),
    )


def bert_plan(base: str = "bert", mlm_decoder: str | None = "cls.predictions.decoder") -> TPPlan:
    """BERT: Megatron's split of every encoder layer.

    Query, key, value and the first MLP layer by output features (each rank keeps
    num_heads / tp heads), the attention output and the second MLP layer by input features.
    The MLM head's transform and the layer norms stay replicated. With parallel_vocab the
    word embedding and the tied MLM decoder are split by vocabulary.
    """
    layer = _at(base, "encoder.layer.*")
    return TPPlan(
        styles={f"{layer}.attention.self.query": "column", f"{layer}.attention.self.key": "column",
                f"{layer}.attention.self.value": "column", f"{layer}.attention.output.dense": "row",
                f"{layer}.intermediate.dense": "column", f"{layer}.output.dense": "row"},
        attributes={f"{layer}.attention.self": ("num_attention_heads", "all_head_size")},
        vocab={_at(base, "embeddings.word_embeddings"): "vocab", mlm_decoder: "column"} if mlm_decoder else {},
    )


T5_EMBEDDINGS = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")


def t5_plan(base: str = "", lm_head: str | None = "lm_head", embeddings: tuple[str, ...] = T5_EMBEDDINGS) -> TPPlan:
    """T5: Megatron's split of every attention (self-attention and the decoder's cross-attention).

    q, k, v by output features (each rank keeps num_heads / tp heads), o by input features;
    the feed-forward's input layers (wi, or wi_0 and wi_1 for gated activations) by output
    features and wo by input features. The first block of each stack owns the relative
    position bias table (buckets x heads): each rank keeps the columns of its heads.
    Attention layers without the table make a zero bias of n_heads heads, hence n_heads is
    divided. With parallel_vocab the token embedding (one weight shared by ``embeddings``
    and ``lm_head``) is split by vocabulary, and so are the logits.
    """
    attention = _at(base, "*.block.*.layer.*.*Attention")  # SelfAttention, and EncDecAttention in the decoder
    feed_forward = _at(base, "*.block.*.layer.*.DenseReluDense")
    vocab = {_at(base, name): "vocab" for name in embeddings}
    return TPPlan(
        styles={f"{attention}.q": "column", f"{attention}.k": "column", f"{attention}.v": "column",
                f"{attention}.o": "row", f"{feed_forward}.wi*": "column", f"{feed_forward}.wo": "row"},
        attributes={attention: ("n_heads", "inner_dim")},
        sliced={_at(base, "*.block.0.layer.0.SelfAttention.relative_attention_bias"): 1},
        vocab={**vocab, lm_head: "column"} if lm_head else {},
    )


def hf_vit_plan(base: str = "vit") -> TPPlan:
    """Transformers' ViT: Megatron's split of every encoder block.

    The query/key/value projections and the first MLP layer by output features (each rank
    keeps num_heads / tp heads), the attention output and the second MLP layer by input
    features. The patch embedding, the layer norms and the classifier stay replicated.
    """
    layer = _at(base, "layers.*")
    return TPPlan(
        styles=_vision_block_styles(layer),
        attributes={f"{layer}.attention": ("num_attention_heads",)},
    )


def hf_swin_plan(base: str = "swin") -> TPPlan:
    """Transformers' Swin: Megatron's split of every Swin block.

    The query/key/value projections and the first MLP layer by output features (each rank
    keeps num_heads / tp heads of its stage), the attention output and the second MLP layer
    by input features; each rank keeps the columns of its heads of the relative position
    bias table (positions x heads). Patch embedding and merging, layer norms and the
    classifier stay replicated.
    """
    block = _at(base, "encoder.layers.*.blocks.*")
    return TPPlan(
        styles=_vision_block_styles(block),
        attributes={f"{block}.attention": ("num_attention_heads",)},
        sliced={f"{block}.attention.relative_position_bias.relative_position_bias_table": 1},
    )


def _base_name(model: nn.Module) -> str:
    """Where a transformers model's base model sits (``""`` when the model is its own base)."""
    base = getattr(model, "base_model", model)
    return next((name for name, module in model.named_modules() if module is base), "")


def _gpt2(model: nn.Module, names: set[str]) -> TPPlan:
    return gpt2_plan(_base_name(model), "lm_head" if "lm_head" in names else None)


def _bert(model: nn.Module, names: set[str]) -> TPPlan:
    return bert_plan(_base_name(model), "cls.predictions.decoder" if "cls.predictions.decoder" in names else None)


def _t5(model: nn.Module, names: set[str]) -> TPPlan:
    base = _base_name(model)
    embeddings = tuple(e for e in T5_EMBEDDINGS if _at(base, e) in names)
    return t5_plan(base, "lm_head" if "lm_head" in names else None, embeddings)


# transformers' config.model_type -> the plan for a model of that family.
_FAMILIES: dict[str, Callable[[nn.Module, set[str]], TPPlan]] = {
    "gpt2": _gpt2, "bert": _bert, "t5": _t5,
    "vit": lambda model, names: hf_vit_plan(_base_name(model)),
    "swin": lambda model, names: hf_swin_plan(_base_name(model)),
}


def family_plan(model: nn.Module) -> TPPlan | None:
    """Merak's plan for a transformers model's family (None when merak has none, or ``model`` is not one)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    build = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return build(model, {name for name, _ in model.named_modules()}) if build is not None else None
