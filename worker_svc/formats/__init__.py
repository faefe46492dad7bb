"""How a model's files store it: its hyper-parameters (a GGUF header or config.json), the
GGUF header itself, and GGUF's 4-bit and 8-bit blocks. The worker's floor: the kernels
compute on these blocks, and the model loads them."""
