"""The engine: requests, scheduler, KV-cache bookkeeping, model runner, sampler."""
