"""Vision Transformer (ViT) image classification: Hugging Face or timm models."""
