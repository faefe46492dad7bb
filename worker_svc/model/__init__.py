"""The model: one module per architecture (llama.py), its layers, the 4-bit and 8-bit
linear layers over GGUF blocks, the decoder's elementwise ops, and weight loading."""
