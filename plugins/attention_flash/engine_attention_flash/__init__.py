"""The flash attention backend plugin of engine."""
