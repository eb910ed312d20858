"""Checkpoints: atomic save, exact resume, loading into any (dp, tp, pp) layout, Hugging Face export.

A checkpoint is a directory ``<output_dir>/checkpoint-<step>/`` holding
safetensors files (weights, optimizer pieces) and JSON (trainer state, RNG
states, a manifest with every file's size and CRC32). Nothing in it is
pickled. See docs/checkpoints.md.
"""

from merak.checkpoint.files import CheckpointError, find_checkpoint, list_checkpoints
from merak.checkpoint.load import load_checkpoint, load_pretrained
from merak.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "find_checkpoint", "list_checkpoints", "load_checkpoint", "load_pretrained",
           "save_checkpoint"]
