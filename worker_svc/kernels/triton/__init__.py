"""The Triton kernels: paged attention, the KV cache write and the decoder's fused
elementwise ops. interpreter.py is imported before each defines a kernel."""
