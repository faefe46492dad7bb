"""The worker role: owns device state (weights, KV cache tensors, batch buffers,
attention backends, sampling) and runs the step plans its scheduler sends.

It serves gRPC `Worker` (describe, execute step) to its own scheduler only. It imports
only `services`, and it is the one role that imports torch. Entry point:
`kvfleet worker` (worker_svc/main.py); the SDK and `kvfleet serve` use `Worker` in-process.
"""
import os

# Before torch loads OpenMP: idle threads sleep instead of spinning (see worker_svc/kernels/cpu/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
