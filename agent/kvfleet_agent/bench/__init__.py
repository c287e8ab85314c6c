"""Load generation and benchmarks against a running agent."""
