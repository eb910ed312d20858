"""The original run_gpt.py command line: see examples/seed_api.py and docs/trainer_api.md."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import merak  # noqa: E402,F401  (before transformers)
from examples.seed_api import main  # noqa: E402

if __name__ == "__main__":
    main("gpt")
