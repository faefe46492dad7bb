"""The tokenizer role: text ⇄ token ids (tokenizers, chat templates) for one model,
plus the tokenizer's files for those who detokenize elsewhere (GetTokenizer).

It serves gRPC `Tokenizer`; stateless, so replicas are interchangeable. It imports
only `services`; never torch (a model whose tokenizer must first be converted is
converted once in a child process). Entry point: `kvfleet tokenizer`
(tokenizer_svc/main.py). Embedded mode calls it in-process (tokenizer_svc/in_process.py).
"""
