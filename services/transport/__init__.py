"""gRPC transports of the roles: services described in Python over msgpack-encoded Structs
(rpc.py, role_services.py), channels, the role server base, the cluster token and TLS.
The in-process classes (Worker, EngineCore, Tokenizer) stay unaware of them."""
