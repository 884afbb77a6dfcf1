"""durable-sessions: check from OpenTelemetry traces that agent sessions survive a crash."""

__version__ = "0.1.0"
