"""gRPC transports of the roles: proto <-> dataclass conversions, each role's server
and client. The in-process classes (Worker, EngineCore, Tokenizer) stay unaware of them."""
