"""Process management: starting the engine cores (local processes or Ray actors) and the DP coordinator."""
