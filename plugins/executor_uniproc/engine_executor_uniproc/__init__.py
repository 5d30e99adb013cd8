"""The uniproc executor plugin of engine."""
