// A step's decoder layers in one call, for a Llama-family model whose 4-bit GGUF projections
// run on kvfleet's int16 GEMMs: the VNNI kernel (vnni_gemm.cpp), which computes the norm and
// the activation before a projection as it quantizes its input, or the AVX2 one
// (int16_gemm.cpp, decode steps of a few rows), after the decoder kernels' norm and
// activation passes. The same kernels' entry points, called in the order and with the
// arguments that llama.py's layers give them, so the output is theirs to the bit. One
// token's Python between those calls took 3 ms of its 8 (a 2-core Sapphire Rapids-class
// Xeon): more than every kernel but the GEMMs.
//
// The kernels live in their own libraries; the caller passes their addresses.
#include <cstdint>

namespace {

using AddNormLinear = void (*)(const float* x, const float* residual, const float* norm_weight, float eps, float* sum,
                               const uint8_t* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                               int threads, int quantize_threads);
using Linear = void (*)(const float* x, int64_t x_stride, const uint8_t* panels, const float* bias, float* y, int64_t M,
                        int64_t K, int64_t N, int threads, int quantize_threads);
using Int16Linear = void (*)(const float* x, int64_t x_stride, const uint8_t* codes, const uint16_t* scale_offsets,
                             const float* bias, float* y, int64_t M, int64_t K, int64_t N, int threads);
using AddRmsNorm = void (*)(const float* x, const float* residual, const float* weight, float* sum, float* out,
                            int64_t rows, int64_t hidden, float eps, int threads);
using SiluAndMul = void (*)(float* gate_up, int64_t rows, int64_t width, int threads);
using Rotary = void (*)(float* q, float* k, const int64_t* positions, const float* cos, const float* sin, int64_t tokens,
                        int64_t q_heads, int64_t k_heads, int64_t dim, int64_t q_stride, int64_t k_stride, int threads);
using WriteKv = int64_t (*)(const float* key, const float* value, void* key_cache, void* value_cache,
                            const int64_t* slots, int64_t tokens, int64_t width, int64_t key_stride,
                            int64_t value_stride, int64_t num_slots, int threads);
// The paged attention kernels (paged_kernel.py): the decode kernel's three work arrays, the prefill kernel's two.
using DecodeAttention = void (*)(const float* query, float* out, const void* key_cache, const void* value_cache,
                                 const int64_t* block_tables, int64_t table_stride, int64_t query_stride,
                                 const int64_t* rows, const int64_t* seqs, const int64_t* seq_lens, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                 const int64_t* bounds, int64_t threads);
using PrefillAttention = void (*)(const float* query, float* out, const void* key_cache, const void* value_cache,
                                  const int64_t* block_tables, int64_t table_stride, int64_t query_stride,
                                  const int64_t* chunks, const int64_t* tiles, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, const int64_t* bounds,
                                  int64_t threads);

}  // namespace

extern "C" {

struct LoopKernels {
  // The VNNI kernel's entry points, the norm and activation computed as it quantizes, or null...
  AddNormLinear add_norm_linear;
  Linear linear;
  Linear silu_and_mul_linear;
  // ... and the AVX2 int16 kernel's, with the decoder kernels' norm and activation passes.
  Int16Linear int16_linear;
  AddRmsNorm add_rms_norm;
  SiluAndMul silu_and_mul;
  Rotary rotary;
  WriteKv write_kv;
  DecodeAttention decode_attention;
  PrefillAttention prefill_attention;
};

struct LoopModel {  // sizes of one layer
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, cache_slots;
  float eps, scale;
};

// A projection's weights: the VNNI kernel's panels (scales null), or the AVX2 kernel's codes
// and (scale, offset) pairs; its bias or null.
struct Projection {
  const uint8_t* weights;
  const uint16_t* scales;
  const float* bias;
};

struct LoopLayer {  // one layer's weights and KV cache
  const float* input_norm;
  Projection qkv, o;
  const float* post_norm;
  Projection gate_up, down;
  void* key_cache;
  void* value_cache;
};

struct GemmThreads {
  int32_t threads, quantize;
};

// One of a step's attention calls, over its decodes or its prompt chunks: `work` the
// kernel's arrays (decodes: rows, seqs, seq_lens; chunks: the chunk table, the tiles).
struct LoopAttention {
  const int64_t* block_tables;
  int64_t table_stride;
  const int64_t* work[3];
  const int64_t* bounds;
  int64_t threads;  // 0: the step has none
};

struct LoopStep {
  int64_t tokens;
  const float* embeddings;  // the first layer's input [tokens, hidden]
  // Buffers: [tokens, qkv width], [tokens, heads * head_dim], [tokens, hidden], [tokens, 2 intermediate],
  // [tokens, hidden] (a norm's output, for the AVX2 kernel), and the outputs, [tokens, hidden] each:
  // the last layer's MLP output and the residual stream.
  float *qkv, *attention, *o, *gate_up, *normed, *hidden, *residual;
  const int64_t* positions;
  const float *cos, *sin;
  const int64_t* slots;
  LoopAttention decodes, chunks;
  GemmThreads qkv_threads, o_threads, gate_up_threads, down_threads;
  int32_t norm_threads, activation_threads, rotary_threads, write_threads;
};

// Runs `count` layers; returns 0, or 1 + the layer whose KV slots were outside its cache (the
// layers after it not run).
int64_t layer_loop(const LoopKernels* k, const LoopModel* m, const LoopLayer* layers, int64_t count,
                   const LoopStep* s) {
  const int64_t T = s->tokens, q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
  const int64_t qkv_width = q_size + 2 * kv_size, gate_up_width = 2 * m->intermediate;
  const auto linear = [&](const float* x, int64_t x_stride, const Projection& p, float* y, int64_t K, int64_t N,
                          GemmThreads t) {
    if (k->linear != nullptr)
      k->linear(x, x_stride, p.weights, p.bias, y, T, K, N, t.threads, t.quantize);
    else
      k->int16_linear(x, x_stride, p.weights, p.scales, p.bias, y, T, K, N, t.threads);
  };
  // linear(norm(h)) for h = x + residual, written to sum, or h = x without a residual.
  const auto norm_linear = [&](const float* x, const float* residual, const float* weight, float* sum,
                               const Projection& p, float* y, int64_t N, GemmThreads t) {
    if (k->add_norm_linear != nullptr) {
      k->add_norm_linear(x, residual, weight, m->eps, sum, p.weights, p.bias, y, T, m->hidden, N, t.threads,
                         t.quantize);
    } else {
      k->add_rms_norm(x, residual, weight, sum, s->normed, T, m->hidden, m->eps, s->norm_threads);
      linear(s->normed, m->hidden, p, y, m->hidden, N, t);
    }
  };
  const float* residual = nullptr;  // the first layer's is its input
  for (int64_t i = 0; i < count; ++i) {
    const LoopLayer& l = layers[i];
    const float* x = i == 0 ? s->embeddings : s->hidden;
    norm_linear(x, residual, l.input_norm, residual ? s->residual : const_cast<float*>(x), l.qkv, s->qkv, qkv_width,
                s->qkv_threads);
    residual = residual ? s->residual : x;
    float *q = s->qkv, *key = q + q_size, *value = key + kv_size;
    k->rotary(q, key, s->positions, s->cos, s->sin, T, m->heads, m->kv_heads, m->head_dim, qkv_width, qkv_width,
              s->rotary_threads);
    if (k->write_kv(key, value, l.key_cache, l.value_cache, s->slots, T, kv_size, qkv_width, qkv_width,
                    m->cache_slots, s->write_threads) != 0)
      return 1 + i;
    if (const LoopAttention& a = s->decodes; a.threads > 0)
      k->decode_attention(q, s->attention, l.key_cache, l.value_cache, a.block_tables, a.table_stride, qkv_width,
                          a.work[0], a.work[1], a.work[2], m->heads, m->kv_heads, m->head_dim, m->block_size, m->scale,
                          a.bounds, a.threads);
    if (const LoopAttention& a = s->chunks; a.threads > 0)
      k->prefill_attention(q, s->attention, l.key_cache, l.value_cache, a.block_tables, a.table_stride, qkv_width,
                           a.work[0], a.work[1], m->heads, m->kv_heads, m->head_dim, m->block_size, m->scale,
                           a.bounds, a.threads);
    linear(s->attention, q_size, l.o, s->o, q_size, m->hidden, s->o_threads);
    norm_linear(s->o, residual, l.post_norm, s->residual, l.gate_up, s->gate_up, gate_up_width, s->gate_up_threads);
    residual = s->residual;
    if (k->silu_and_mul_linear != nullptr) {
      k->silu_and_mul_linear(s->gate_up, gate_up_width, l.down.weights, l.down.bias, s->hidden, T, m->intermediate,
                             m->hidden, s->down_threads.threads, s->down_threads.quantize);
    } else {
      k->silu_and_mul(s->gate_up, T, m->intermediate, s->activation_threads);
      linear(s->gate_up, gate_up_width, l.down, s->hidden, m->intermediate, m->hidden, s->down_threads);
    }
  }
  return 0;
}

}  // extern "C"
