"""Checks of the CUDA/NCCL paths on a real GPU (docs/gpu.md); skipped without CUDA."""
