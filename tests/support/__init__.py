"""Test helpers: the fake OpenAI-compatible server."""
