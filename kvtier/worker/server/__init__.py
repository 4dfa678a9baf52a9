"""The worker's HTTP server: OpenAI-compatible endpoints in front of the engine."""
