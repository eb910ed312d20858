"""One worker's training session, assembled from the run settings.

- :mod:`merak.session.assemble`: the worker's model and stages (build, plan, materialize its own stage);
- :mod:`merak.session.training`: ``TrainingSession``, the run loop (data, steps, evaluation,
  checkpoints, reports);
- :mod:`merak.session.run_directory`: one run per output directory.
"""
