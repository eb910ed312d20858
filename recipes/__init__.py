"""Ready-to-run, ready-to-copy model recipes for merak."""
