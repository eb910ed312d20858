"""T5 encoder-decoder (sequence-to-sequence) models."""
