"""EngineCore, its clients, LLMEngine and the offline LLM entry point."""
