"""FP8 quantization of grouped tensors: scales, FP8 copies and their references."""
