"""What makes a step: the model, optimizer, parallelism, fused kernels, CUDA graphs, the loop's collectives, metrics."""
