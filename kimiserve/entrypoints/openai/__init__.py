"""OpenAI-compatible HTTP server: protocol, parsers, async engine, FastAPI app."""
