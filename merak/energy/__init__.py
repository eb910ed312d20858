"""Energy-aware pipeline training: GPU backends, instruction profiles, frequency plans, zeus.

- :mod:`merak.energy.device`: the GPU interface; :mod:`~merak.energy.nvml` and
  :mod:`~merak.energy.simulated` implement it.
- :mod:`merak.energy.profile_csv`: the instruction profile file (Merak-Zeus's format).
- :mod:`merak.energy.dag` and :mod:`merak.energy.planner`: the time-energy frontier of a
  schedule's step, and per-instruction clock plans; :mod:`merak.energy.frontier` its file.
- :mod:`merak.energy.straggler`: data-parallel pipelines moving along the frontier to a
  straggler's time.
- :mod:`merak.energy.runtime`: a worker's device, listeners and reports (every run measures
  where it can); :mod:`merak.energy.figures` the figures it reports.
"""
