"""BERT masked language models."""
