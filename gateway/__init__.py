"""The gateway role: owns the client connection (HTTP, auth, validation, SSE, request
ids, incremental detokenization and stop strings) and chooses a scheduler replica.

It speaks OpenAI REST in; in a cluster it calls the tokenizer role and the schedulers
over gRPC (its clients live in gateway/cluster/) and reads its token stream from NATS. It imports
`services` and, as a library, the tokenizer role's text modules
(`tokenizer_svc.tokenizer`, `.detokenizer`, `.text_output`); never torch.
Entry point: `kvfleet gateway` (gateway/main.py); `kvfleet serve` builds the same app
over an embedded engine.
"""
