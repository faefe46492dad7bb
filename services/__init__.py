"""The floor every role stands on: the shared vocabulary (every message between
processes, as msgspec Structs that are also the wire format; sampling params, config,
errors, the engine client interface, the tokenizer interface), the roles' gRPC service
descriptions, gRPC channels and the role server base, the NATS connection, the Redis
registry, telemetry and the command-line flags.

It imports no role, no `kvfleet` and never torch (checked by `lint-imports`), so any
role process can load it. It has no entry point of its own.
"""
