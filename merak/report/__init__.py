"""What a run shows and leaves behind.

- :mod:`merak.report.console`: one log format for the launching process and the workers;
- :mod:`merak.report.metrics`: progress bar, metrics.jsonl, summary.json, the summary table;
- :mod:`merak.report.curves`: loss.png of a run (loss and learning rate per step) and of a sweep;
- :mod:`merak.report.trackers`: experiment trackers (TensorBoard, Weights & Biases, ...);
- :mod:`merak.report.sweep`: the table of a Hydra multirun sweep;
- :mod:`merak.report.settings`: the ``report`` section of the ``trainer`` config.
"""
