"""What one request's decode step reads, and the roofline it sets (benchmarks/roofline.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step of one request reads."""

    weights: int  # every weight the step reads, as stored
    kv_per_token: int  # K and V of one context token over all layers

    def per_token(self, context: float) -> float:
        return self.weights + context * self.kv_per_token

    def roofline(self, bandwidth: float, context: float) -> float:
        """The most tokens/s a stream at this context can decode at `bandwidth` bytes/s."""
        return bandwidth / self.per_token(context)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * element_bytes  # K and V


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes a 1-row step reads, by kind, from the model as loaded with --quantization gguf:
    the 4-bit projections as their kernel reads them (the AVX-512 VNNI kernel's panels, else
    the AVX2 kernels' packed codes and scales), the LM head's 8-bit blocks or panels, the
    norms; the embedding contributes a row."""
    from worker_svc.model.q4_linear import Q4Linear
    from worker_svc.model.q8_linear import Q8Linear

    kinds = {"q4_projections": 0, "q8_lm_head": 0, "norms": 0, "embedding_row": 0}
    for module in model.modules():
        if isinstance(module, Q4Linear):
            if module.panels is not None:
                kinds["q4_projections"] += module.panels.panels.nbytes
            else:
                assert module.packed is not None, "no 4-bit kernel built"
                kinds["q4_projections"] += module.packed.codes.nbytes + module.packed.scale_offsets.nbytes
        elif isinstance(module, Q8Linear):
            kinds["q8_lm_head"] += module.panels.panels.nbytes if module.panels is not None else module.blocks.nbytes
            kinds["embedding_row"] += module.blocks.nbytes // module.out_features
    kinds["norms"] = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("norm.weight"))
    return kinds
