"""The scheduling core: requests, the scheduler, KV-cache bookkeeping and the plain-data step plan; no torch."""
