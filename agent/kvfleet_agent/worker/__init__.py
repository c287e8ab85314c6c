"""What runs the model: device policy, step batches, the model runner, CUDA graphs, sampling, ranks and the executor."""
