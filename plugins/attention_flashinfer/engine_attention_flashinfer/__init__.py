"""The flashinfer attention backend plugin of engine."""
