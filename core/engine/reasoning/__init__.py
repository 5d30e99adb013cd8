"""Built-in reasoning parsers (the ``reasoning_parser`` plugin kind)."""
