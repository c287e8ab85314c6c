"""The engine: the step loop over scheduler and executor, detokenizing, and AsyncLLM, the facade the server uses."""
