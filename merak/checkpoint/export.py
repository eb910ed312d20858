"""Export a checkpoint as a plain Hugging Face model directory (``from_pretrained`` loads it).

Usage: ``merak-export CHECKPOINT OUT_DIR``. Works from any saving layout: the
full tensors are joined from the tensor-parallel slices of every stage.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from merak.checkpoint.files import CheckpointError
from merak.checkpoint.load import CheckpointSource
from merak.checkpoint.pretrained import write_pretrained

logger = logging.getLogger(__name__)


def export_pretrained(checkpoint: str, out_dir: str, *, dtype: torch.dtype | None = None) -> str:
    """Write ``out_dir`` with config.json and model.safetensors; return ``out_dir``.

    Models that are not Hugging Face models get model.safetensors (full tensors by name) only.
    Only the weights files are read, each checked against the manifest first.

    Raises:
        CheckpointError: a weights file is missing, truncated, damaged or unreadable (named), or the
            tensors do not fit the model class.
    """
    source = CheckpointSource(checkpoint)
    state = {name: source.weight(name) for name in source.weight_names()}
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    return write_pretrained(state, source.manifest.get("model_info"), out_dir, source=checkpoint)


def main(argv: list[str] | None = None, *, prog: str = "merak-export") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (…/checkpoint-<step>)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="cast floating-point weights (default: as saved)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        export_pretrained(args.checkpoint, args.out_dir, dtype=getattr(torch, args.dtype) if args.dtype else None)
    except CheckpointError as error:  # the message names the file and what is wrong: no traceback
        logger.error("merak-export: %s", error)
        return 2
    except OSError as error:  # OUT_DIR cannot be written: a file, read-only, a full disk
        logger.error("merak-export: cannot write %s: %s", args.out_dir,
                     f"{error.strerror} ({error.filename})" if error.strerror else error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
