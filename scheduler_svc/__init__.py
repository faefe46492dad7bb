"""The scheduler role: owns request lifecycle and KV bookkeeping (waiting/running/swapped
queues, the block pool and block tables, the prefix-cache hash table, the token budget
per step, preemption) and the step loop that drives its worker group.

It serves gRPC `Scheduler` (submit, abort, stats, output streams), calls its workers
over gRPC (scheduler_svc/worker_client.py), publishes token deltas on NATS and holds
a lease in Redis. It imports only `services`; never torch, and no model files.
Entry point: `kvfleet scheduler` (scheduler_svc/main.py). The embedded engine
(kvfleet/async_engine.py) is the same EngineCore, streamed to asyncio in-process.
"""
