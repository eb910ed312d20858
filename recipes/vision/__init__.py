"""Shared helpers for the image-classification recipes (vit, swin, wide_resnet): data, loss and config fields."""
