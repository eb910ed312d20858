"""``python -m merak``: the ``merak`` command (merak.cli)."""

import sys

from merak.cli import main

sys.exit(main())
