"""Grouped GEMMs: plain PyTorch, Triton and Gluon, bf16 and FP8."""
