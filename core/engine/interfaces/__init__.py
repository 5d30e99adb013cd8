"""Base classes that plugins implement."""
