"""engine plugin: the guidance (llguidance) structured-output backend."""
