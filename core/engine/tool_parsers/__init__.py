"""Built-in tool-call parsers (the ``tool_parser`` plugin kind)."""
