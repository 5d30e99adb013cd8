"""engine's Ray executor: one Ray actor per tensor-parallel rank, placed by a placement group."""
