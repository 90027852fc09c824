"""Tensor parallelism over torch.distributed: sharding, the communicator the forward calls, the
executor that drives the worker ranks, and the worker process."""
