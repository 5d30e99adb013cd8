"""The engine core: the busy loop around the scheduler and the executor, in process or as EngineCoreProc."""
