"""Quantized weights: layers and kernels, reading every common on-disk format, writing them."""
