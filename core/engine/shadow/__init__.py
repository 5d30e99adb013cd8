"""Shadow A/B: a second engine core re-runs a sample of the served requests, teacher-forced on the primary's
tokens, and the comparison says whether its config is equivalent and whether it is faster (``GET /v1/shadow``)."""
