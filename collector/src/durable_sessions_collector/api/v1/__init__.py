"""Generated code of ``proto/durable_sessions/v1/sessions.proto`` (``make proto``; do not edit)."""
