"""The Triton attention backend plugin of engine."""
