"""The seed API for the user's own model: MerakArguments and MerakTrainer (imports transformers)."""

from merak.hf.arguments import MerakArguments
from merak.hf.trainer import MerakTrainer

__all__ = ["MerakArguments", "MerakTrainer"]
