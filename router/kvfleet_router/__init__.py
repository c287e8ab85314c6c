"""kvfleet-router: one OpenAI endpoint for a fleet of agents, routing each request by load and prefix affinity."""
