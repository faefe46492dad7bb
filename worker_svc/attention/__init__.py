"""Attention backends, named for where they run: cpu.py (torch, with the C++ paged kernels)
and gpu.py (the Triton kernels), behind backend.py's interface."""
