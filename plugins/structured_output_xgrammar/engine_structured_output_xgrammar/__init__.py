"""engine plugin: the xgrammar structured-output backend."""
