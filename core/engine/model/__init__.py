"""Models, their layers, weight loading and tokenizers."""
