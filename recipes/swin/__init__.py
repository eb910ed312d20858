"""Swin Transformer image classification: Hugging Face or timm models."""
