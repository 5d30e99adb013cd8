"""The front end: LLM, AsyncLLM and LLMEngine, input and output processing, the engine-core clients."""
