"""The agent process: HTTP (OpenAI-compatible) and gRPC serving, metrics, health and drain."""
