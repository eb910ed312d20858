"""Checkpoints: atomic save, exact resume, loading into any (dp, tp, pp) layout, Hugging Face export.

A checkpoint is a directory ``<output_dir>/checkpoint-<step>/`` holding
safetensors files (weights, optimizer pieces) and JSON (trainer state, RNG
states, a manifest with every file's size and CRC32). Nothing in it is
pickled. Every file is checked against the manifest before it is read; a
damaged checkpoint raises CheckpointError naming the file. See docs/checkpoints.md.
"""

from merak.checkpoint.files import (
    CheckpointError,
    find_checkpoint,
    list_checkpoints,
    newest_intact_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from merak.checkpoint.load import load_checkpoint, load_pretrained
from merak.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "find_checkpoint", "list_checkpoints", "load_checkpoint", "load_pretrained",
           "newest_intact_checkpoint", "read_manifest", "save_checkpoint", "verify_checkpoint"]
