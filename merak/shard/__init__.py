"""Cutting a model into pipeline stages."""
