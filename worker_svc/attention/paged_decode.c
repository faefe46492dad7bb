/* Paged attention for decode rows (one query token each), float32, read in place.
 *
 * The torch path gathers every request's K and V blocks into a padded copy before
 * attending; for decode that copy is most of the memory traffic. This reads each
 * block where it lies in the cache, once, with an online softmax.
 *
 * Layouts (all contiguous):
 *   query, out   [num_tokens, num_heads, head_dim]
 *   key_cache,
 *   value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs_in_table, table_stride] (int64)
 *   rows, seqs, seq_lens: per decode i, its row in query/out, its row in
 *   block_tables, and its context length (keys, this step's included).
 * Work is split by (decode, kv head) pairs in [first, last), so callers can run
 * disjoint ranges on several threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16   /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define CHUNK 64       /* keys scored before their values are summed */

void paged_decode_attention(
    const float *query, float *out, const float *key_cache, const float *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *rows, const int64_t *seqs, const int64_t *seq_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t first, int64_t last)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    for (int64_t item = first; item < last; item++) {
        const int64_t i = item / num_kv_heads, kv = item % num_kv_heads;
        const float *q = query + rows[i] * num_heads * head_dim + kv * group * head_dim;
        const int64_t *table = block_tables + seqs[i] * table_stride;
        const int64_t len = seq_lens[i];
        float maxes[MAX_GROUP], sums[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM], scores[MAX_GROUP][CHUNK];
        const float *keys[CHUNK];
        for (int64_t g = 0; g < group; g++) {
            maxes[g] = -INFINITY;
            sums[g] = 0.0f;
            memset(acc[g], 0, sizeof(float) * head_dim);
        }
        /* A chunk at a time: its scores first, then one rescale per chunk rather than per key. */
        for (int64_t chunk = 0; chunk < len; chunk += CHUNK) {
            const int64_t n = len - chunk < CHUNK ? len - chunk : CHUNK;
            for (int64_t j = 0; j < n; j++) {
                const int64_t pos = chunk + j;
                keys[j] = key_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride
                          + kv * head_dim;
            }
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                float chunk_max = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    const float *k = keys[j];
                    float score = 0.0f;
#pragma omp simd reduction(+ : score)
                    for (int64_t d = 0; d < head_dim; d++) score += qg[d] * k[d];
                    scores[g][j] = score * scale;
                    if (scores[g][j] > chunk_max) chunk_max = scores[g][j];
                }
                if (chunk_max > maxes[g]) {  /* rescale what was summed under the old maximum */
                    const float correction = expf(maxes[g] - chunk_max);
                    sums[g] *= correction;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
                    maxes[g] = chunk_max;
                }
                for (int64_t j = 0; j < n; j++) {
                    scores[g][j] = expf(scores[g][j] - maxes[g]);
                    sums[g] += scores[g][j];
                }
            }
            for (int64_t j = 0; j < n; j++) {
                const float *v = value_cache + (keys[j] - key_cache);
                for (int64_t g = 0; g < group; g++) {
                    const float weight = scores[g][j];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] += weight * v[d];
                }
            }
        }
        float *o = out + rows[i] * num_heads * head_dim + kv * group * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float inv = 1.0f / sums[g];
            for (int64_t d = 0; d < head_dim; d++) o[g * head_dim + d] = acc[g][d] * inv;
        }
    }
}
