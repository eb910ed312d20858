"""Llama-family causal language models (transformers' LlamaForCausalLM)."""
