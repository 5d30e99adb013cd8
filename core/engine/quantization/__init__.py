"""The built-in quantization methods (``methods``: none, gguf, int8); their packed formats are model code
(``engine.model.quant_formats``)."""
