"""The worker's kernels: C++ for the CPU (`cpu/`) and Triton for GPUs (`triton/`). They
import nothing of the runtime, the model, attention or the group (lint-imports checks it)."""
