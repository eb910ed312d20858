"""Graph capture of unmodified models and meta-device construction of giant ones."""
