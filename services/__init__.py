"""The floor every role stands on: the shared vocabulary (messages, sampling params,
config, errors, the engine client interface, the tokenizer interface), proto stubs
and conversions, gRPC channels and the role server base, the NATS connection, the
Redis registry, telemetry and the command-line flags.

It imports no role, no `kvfleet` and never torch (checked by `lint-imports`), so any
role process can load it. It has no entry point of its own.
"""
