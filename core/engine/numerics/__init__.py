"""The numerics oracle (``engine check numerics``): the engine's activations at every layer boundary against a
float64 reference of the same weights, the first op that leaves the dtype's tolerance, and the plugin to blame."""
