"""The scheduler's door for vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`,
PyPI smg-grpc-proto), for routers built for vLLM's gRPC server: the servicer
(server.py), the protocol's messages to kvfleet's types and back (convert.py), its
text side (text.py: text prompts, stop strings, tokenizer files) and its KV event
stream (kv_events.py). The step loop it fronts knows nothing of it.
"""
