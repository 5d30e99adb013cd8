"""The multiproc executor plugin of engine."""
