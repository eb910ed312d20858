"""The original run_swin.py command line (Swin Transformer): see examples/seed_api.py and docs/trainer_api.md."""

import os
import sys

# realpath: a symbolic link to this script, made elsewhere, still finds the repository.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import merak  # noqa: F401  (before transformers)
from examples.seed_api import main

if __name__ == "__main__":
    main("swin")
