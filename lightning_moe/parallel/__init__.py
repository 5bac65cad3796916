"""Applying expert, tensor and data parallelism (FSDP2) to a module, given a ParallelLayout."""
