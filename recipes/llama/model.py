"""Model factory: a plain Hugging Face Llama (LlamaForCausalLM) built from a config (random init, no download)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from recipes.gpt import model as gpt_model


def llama_config(model_cfg) -> LlamaConfig:
    """The transformers config of ``model_cfg`` (conf/model/*.yaml)."""
    rope = {"rope_type": "default", "rope_theta": float(model_cfg.rope_theta)}
    if model_cfg.get("rope_scaling"):
        # Llama 3.1+'s long-context frequencies (rope_type llama3 with its factors), as in the public configs.
        rope = {**dict(model_cfg.rope_scaling), "rope_theta": float(model_cfg.rope_theta)}
    config = LlamaConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.rms_norm_eps,
        rope_parameters=rope,
        attention_dropout=model_cfg.dropout,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(model_cfg) -> LlamaForCausalLM:
    """A LlamaForCausalLM with the sizes in ``model_cfg``."""
    return LlamaForCausalLM(llama_config(model_cfg))


# The same text and loss as the gpt recipe: every sample one block of seq_length tokens, next-token loss.
tokens_per_sample = gpt_model.tokens_per_sample
causal_lm_loss = gpt_model.causal_lm_loss
