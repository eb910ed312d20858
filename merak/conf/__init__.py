"""Shared Hydra config groups (parallel/, trainer/, launcher/), found through pkg://merak.conf."""
