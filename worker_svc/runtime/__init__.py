"""The worker at run time: its device and precision, the checks before loading, the
persistent batch, the KV cache and its sizing, CUDA graphs, and the step plans it runs."""
