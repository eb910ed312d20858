"""Gradient synchronisation, clipping, optimizers and learning-rate schedules."""
