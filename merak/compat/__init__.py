"""Workarounds for the package ecosystem, applied once when merak is imported."""
