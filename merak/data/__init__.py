"""Layout-independent batching: which samples each rank loads for each step."""
