"""EAGLE and EAGLE-3 heads written by the tests, in vLLM's checkpoint format, for a target
whose config and weights they are given. No trained head exists here: see write_eagle_head."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker_svc.formats.model_config import ModelConfig

# The EAGLE-3 test head's draft vocabulary (real heads keep the target's most used tokens).
DRAFT_VOCAB = [*range(100), *range(150, 8000), *range(46000, 47000)]


def write_eagle_head(directory: Path, method: str, config: ModelConfig, weights: dict[str, torch.Tensor]) -> Path:
    """An EAGLE (or EAGLE-3) head for the target of `config` in vLLM's checkpoint format. No trained
    head exists here: its attention and MLP weights are random, with their output projections
    zeroed, and fc passes the target's hidden state through (EAGLE: its last one; EAGLE-3: the
    input of its last layer), so the head drafts the target's own prediction at the row before
    the newest token (that token itself), then repeats it: drafts accepted on repetitive text
    only, and the plumbing of hidden states, positions and KV is checked exactly. The EAGLE-3
    head has its own LM head (the target's embedding rows) over a draft vocabulary of 8950
    tokens (DRAFT_VOCAB), mapped back by d2t."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    width, inputs, layer = (2 * hidden, 3, "midlayer.") if method == "eagle3" else (hidden, 2, "layers.0.")
    random = torch.Generator().manual_seed(0)
    tensors = {f"{layer}{name}": torch.randn(*shape, generator=random) * 0.02 for name, shape in [
        ("self_attn.q_proj.weight", (q, width)), ("self_attn.k_proj.weight", (kv, width)),
        ("self_attn.v_proj.weight", (kv, width)), ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden))]}
    tensors |= {f"{layer}self_attn.o_proj.weight": torch.zeros(hidden, q),
                f"{layer}mlp.down_proj.weight": torch.zeros(hidden, inter),
                f"{layer}post_attention_layernorm.weight": torch.ones(hidden),
                "fc.weight": torch.cat([torch.zeros(hidden, (inputs - 1) * hidden), torch.eye(hidden)], dim=1)}
    head_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                   "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": config.num_attention_heads,
                   "num_key_value_heads": config.num_key_value_heads, "rms_norm_eps": config.rms_norm_eps,
                   "vocab_size": config.vocab_size, "max_position_embeddings": 2048}
    if method == "eagle3":
        kept = torch.tensor(DRAFT_VOCAB)
        tensors |= {f"{layer}input_layernorm.weight": torch.ones(hidden), f"{layer}hidden_norm.weight": torch.ones(hidden),
                    "norm.weight": weights["model.norm.weight"],
                    "lm_head.weight": weights["model.embed_tokens.weight"][kept],
                    "d2t": kept - torch.arange(len(kept)), "t2d": torch.zeros(config.vocab_size, dtype=torch.bool)}
        head_config |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(kept),
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, config.num_hidden_layers - 1]}}
    save_file({name: t.to(torch.float16) if t.is_floating_point() else t for name, t in tensors.items()},
              directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(head_config))
    return directory
