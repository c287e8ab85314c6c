"""Tensor parallelism: the rank group and its collectives, worker processes, and the executor that drives them."""
