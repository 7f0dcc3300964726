"""Tensor parallelism's process group and collectives (parallel_state.py)."""
