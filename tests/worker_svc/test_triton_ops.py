"""The fused Triton kernels (worker_svc/kernels/triton/decoder_ops.py) against the torch operators they
replace, run through Triton's interpreter on this CPU: odd widths, several head layouts,
q/k as strided views of a fused qkv projection; and a tiny random Llama that gives the
same hidden states and logits with torch's operators, the Triton kernels and the CPU
decoder kernels (worker_svc/kernels/cpu/decoder_ops.py, whose own tests are test_decoder_kernel.py).

bfloat16 is compared loosely: the interpreter rounds float32 to bfloat16 toward zero
(a GPU rounds to nearest), so its results sit up to an ulp or two from torch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.attention.backend import BatchLayout
from worker_svc.attention.cpu import TorchAttentionBackend
from worker_svc.formats.model_config import ModelConfig
from worker_svc.group.rank_group import RankGroup
from worker_svc.kernels.cpu import decoder_ops as cpu_kernels
from worker_svc.kernels.triton import decoder_ops as triton_kernels
from worker_svc.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.ops import CpuOps, Ops, TorchOps, TritonOps

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 33]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("width", [576, 64])  # SmolLM2's hidden size is no power of two
def test_rms_norm_matches_rmsnorm(width: int, num_tokens: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(width, 1e-5).to(dtype).requires_grad_(False)
    norm.weight.normal_(1.0, 0.3)
    x, residual = (torch.randn(num_tokens, width, dtype=dtype) for _ in range(2))
    assert_close(triton_kernels.rms_norm(x, norm.weight, norm.eps), norm(x))
    normed, summed = triton_kernels.rms_norm(x, norm.weight, norm.eps, residual)
    assert_close(summed, x + residual)
    assert_close(normed, norm(x + residual))


def test_rms_norm_reads_rows_of_a_wider_tensor() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-6).requires_grad_(False)
    norm.weight.normal_(1.0, 0.3)
    wide = torch.randn(7, 1000)
    x, residual = wide[:, :576], wide[:, 400:976]
    normed, summed = triton_kernels.rms_norm(x, norm.weight, norm.eps, residual)
    assert_close(summed, x + residual)
    assert_close(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 1, 128)])
def test_rotary_in_place_on_qkv_views_matches_apply_rotary(
    num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    positions = torch.randint(0, 4096, (num_tokens,))
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(rotary.tables(positions, dtype), q, k)
    untouched = v.clone()
    triton_kernels.rotary_(q, k, positions, rotary.cos, rotary.sin)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(v, untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("inner", [1536, 100])  # SmolLM2's intermediate size spans two programs
def test_silu_and_mul_matches_torch(inner: int, num_tokens: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 2 * inner, dtype=dtype) * 3
    gate, up = x.chunk(2, dim=-1)
    assert_close(triton_kernels.silu_and_mul(x), F.silu(gate) * up)


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random transformers Llama: 3 query heads on 1 KV head, widths that are no power of two."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_config = LlamaConfig(vocab_size=500, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
                            tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    weights = HFLlama(hf_config).eval().state_dict()
    config = ModelConfig(
        architecture="llama", vocab_size=500, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=32, rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
    )
    return config, weights


def _run(config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops) -> list[torch.Tensor]:
    """Hidden states and sampled rows' logits of a two-prompt prefill, then a decode step of both."""
    backend = TorchAttentionBackend(cache_writer=ops.kernel if isinstance(ops, CpuOps) else None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, 256, torch.device("cpu"), RankGroup(), ops)
    model.load_weights({name: tensor.clone() for name, tensor in weights.items()})
    block_size, num_blocks = 4, 8
    caches = [torch.zeros(2, num_blocks, block_size, 1, config.head_dim) for _ in range(config.num_hidden_layers)]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    generator = torch.Generator().manual_seed(1)
    outputs = []
    for query_lens, seq_lens in (([5, 9], [5, 9]), ([1, 1], [6, 10])):
        positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens)])
        slots = torch.cat([tables[i][positions_i // block_size] * block_size + positions_i % block_size
                           for i, positions_i in enumerate(positions.split(query_lens))])
        layout = BatchLayout(torch.tensor(query_lens), torch.tensor(seq_lens), tables, slots, block_size, max(query_lens))
        input_ids = torch.randint(0, config.vocab_size, (len(positions),), generator=generator)
        hidden = model(input_ids, positions, caches, backend.build_metadata(layout))
        outputs += [hidden, model.compute_logits(hidden[torch.tensor(query_lens).cumsum(0) - 1])]
    return outputs


@pytest.mark.parametrize("fused", ["triton", "cpu"])
def test_llama_gives_the_same_hidden_states_with_fused_ops(tiny_llama, fused: str) -> None:
    config, weights = tiny_llama
    if fused == "cpu" and cpu_kernels.load() is None:
        pytest.skip("the CPU decoder kernels need a C++ compiler and AVX2")
    ops = TritonOps() if fused == "triton" else CpuOps(cpu_kernels.load())
    for torch_out, fused_out in zip(_run(config, weights, TorchOps()), _run(config, weights, ops), strict=True):
        torch.testing.assert_close(fused_out, torch_out, atol=1e-4, rtol=1e-4)
