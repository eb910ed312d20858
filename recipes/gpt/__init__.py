"""GPT-2 / GPT-3 style causal language models."""
