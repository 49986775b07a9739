"""Compute kernels and their plain-PyTorch references: tensors in, tensors out."""
