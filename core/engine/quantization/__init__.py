"""Quantized weights: packed formats (``formats``) and the built-in quantization methods (``methods``)."""
