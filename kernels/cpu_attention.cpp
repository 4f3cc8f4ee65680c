// Attention of a ragged batch's short query runs (decodes, drafts to verify) over a slot cache, on the CPU.
//
// Built on first use by cascade/stages/cpu_attention.py (torch.utils.cpp_extension, -O3 -march=native) and registered
// as torch.ops.cascade_cpu.ragged_attention. PyTorch's scaled_dot_product_attention needs a rectangle: every
// sequence's keys padded to the longest in the batch, read and masked. Here each query row reads exactly its own
// sequence's keys, straight from the cache, so a batch of mixed lengths costs what its real positions cost. The work
// is split over (sequence, KV head) pairs with at::parallel_for, on PyTorch's own thread pool, in chunks large enough
// to be worth a thread (a small call runs on the calling thread alone).
//
// Numerics: in the tensors' dtype (float32 or float64) throughout, scores max-subtracted before exp; the result equals
// SDPA's to that dtype's rounding (the sums run in another order). -ffast-math is safe here because nothing infinite or NaN is ever formed from finite
// inputs: the running maximum starts at the first score, and every exponent is <= 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// One query row of one head: o = softmax(q·K[0..L)ᵀ · scale) · V[0..L). K and V rows are `key_stride` and
// `value_stride` floats apart (a slot's positions); `scores` has room for L floats. D > 0 fixes the head size at
// compile time (the query and the accumulator then live in registers); D == 0 reads it from `dim`.
template <typename T, int64_t D>
void attend_row(const T* __restrict query, const T* __restrict keys, const T* __restrict values,
                int64_t key_stride, int64_t value_stride, int64_t length, int64_t dim, T scale,
                T* __restrict scores, T* __restrict out) {
  constexpr int64_t kMaxDim = 256;
  const int64_t n = D > 0 ? D : dim;
  T q[D > 0 ? D : kMaxDim];
  T acc[D > 0 ? D : kMaxDim];
  for (int64_t d = 0; d < n; ++d) {
    q[d] = query[d] * scale;
    acc[d] = 0;
  }
  T top = 0;
  for (int64_t l = 0; l < length; ++l) {
    const T* __restrict k = keys + l * key_stride;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < n; ++d) dot += q[d] * k[d];
    scores[l] = dot;
    top = (l == 0 || dot > top) ? dot : top;
  }
  T total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t l = 0; l < length; ++l) {
    scores[l] = std::exp(scores[l] - top);
    total += scores[l];
  }
  for (int64_t l = 0; l < length; ++l) {
    const T* __restrict v = values + l * value_stride;
    const T p = scores[l];
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
  }
  const T inverse = T(1) / total;
  for (int64_t d = 0; d < n; ++d) out[d] = acc[d] * inverse;
}

template <typename T>
using RowFn = void (*)(const T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, T, T*, T*);

template <typename T>
RowFn<T> row_function(int64_t dim) {
  switch (dim) {
    case 64: return attend_row<T, 64>;
    case 128: return attend_row<T, 128>;
    case 32: return attend_row<T, 32>;
    case 96: return attend_row<T, 96>;
    case 80: return attend_row<T, 80>;
    default: return attend_row<T, 0>;
  }
}

template <typename T>
void attend_all(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const int64_t* slot,
                const int64_t* start, const int64_t* cu, int64_t batch, double scale, at::Tensor& out) {
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = keys.size(1);
  const int64_t group = heads / kv_heads;
  const T* q = query.data_ptr<T>();
  const T* k = keys.data_ptr<T>();
  const T* v = values.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t slot_k = keys.stride(0), head_k = keys.stride(1), pos_k = keys.stride(2);
  const int64_t slot_v = values.stride(0), head_v = values.stride(1), pos_v = values.stride(2);
  const RowFn<T> attend = row_function<T>(dim);
  const T scale_t = static_cast<T>(scale);
  // A chunk of tasks handed to a thread is at least kMinChunkWork multiply-adds: a parallel region ends in a
  // barrier, so a step's small attention (one sequence, a few hundred positions: ~5 us on one core) waited for a
  // second core that the server's event loop or its clients held, up to a scheduler slice. Measured in
  // `cascade serve` at one client (py-spy): attention took half of the demo target's decode step, 3% in one process;
  // with the chunks, 5% there.
  constexpr int64_t kMinChunkWork = int64_t(1) << 18;
  int64_t work = 0;  // multiply-adds of the whole call: q·k and p·v per query row, head and attended position
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t rows = cu[b + 1] - cu[b];
    work += rows * (start[b] + (rows + 1) / 2) * heads * dim * 2;
  }
  const int64_t tasks = batch * kv_heads;
  const int64_t grain = std::max<int64_t>(1, (kMinChunkWork * tasks + work - 1) / std::max<int64_t>(work, 1));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kv = task % kv_heads;
      const T* seq_keys = k + slot[b] * slot_k + kv * head_k;
      const T* seq_values = v + slot[b] * slot_v + kv * head_v;
      for (int64_t row = cu[b]; row < cu[b + 1]; ++row) {
        const int64_t length = start[b] + (row - cu[b]) + 1;
        if (static_cast<int64_t>(scores.size()) < length) scores.resize(length);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          attend(q + (row * heads + h) * dim, seq_keys, seq_values, pos_k, pos_v, length, dim, scale_t,
                 scores.data(), o + (row * heads + h) * dim);
        }
      }
    }
  });
}

// query: [N, heads, D] (each sequence's rows together, in order); keys, values: [slots, kv_heads, capacity, D] with
// unit stride along D; seq_slot, seq_start: [B] int64 (a sequence's cache slot, and how many of its positions were
// cached before its first row); cu_rows: [B + 1] int64 (its rows are cu_rows[b] .. cu_rows[b + 1] - 1). Row
// cu_rows[b] + i is the query at position seq_start[b] + i and attends keys 0 .. seq_start[b] + i, which the caller
// has already written. Returns [N, heads, D].
at::Tensor ragged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& seq_slot, const at::Tensor& seq_start, const at::Tensor& cu_rows,
                            double scale) {
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(), "CPU tensors only");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kDouble) && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype, "float32 or float64 tensors, all of one dtype");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [N, heads, head_dim]");
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.stride(3) == 1 && values.stride(3) == 1,
              "keys and values must be [slots, kv_heads, capacity, head_dim] with unit stride along head_dim");
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(3) == dim && values.size(3) == dim, "head_dim differs between query and cache");
  TORCH_CHECK(dim <= 256, "head_dim above 256 is not supported");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  for (const at::Tensor* t : {&seq_slot, &seq_start, &cu_rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "index tensors: 1-D int64");
  }
  const int64_t batch = seq_slot.size(0);
  TORCH_CHECK(seq_start.size(0) == batch && cu_rows.size(0) == batch + 1, "index tensors disagree on the batch");
  const int64_t* slot = seq_slot.data_ptr<int64_t>();
  const int64_t* start = seq_start.data_ptr<int64_t>();
  const int64_t* cu = cu_rows.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == query.size(0), "cu_rows must run from 0 to the number of rows");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < keys.size(0), "slot out of range");
    TORCH_CHECK(cu[b + 1] >= cu[b] && start[b] >= 0 && start[b] + (cu[b + 1] - cu[b]) <= keys.size(2),
                "a sequence's rows run past the cache's capacity");
  }

  auto out = at::empty_like(query);
  if (dtype == at::kFloat) {
    attend_all<float>(query, keys, values, slot, start, cu, batch, scale, out);
  } else {
    attend_all<double>(query, keys, values, slot, start, cu, batch, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(cascade_cpu, m) {
  m.def("ragged_attention(Tensor query, Tensor keys, Tensor values, Tensor seq_slot, Tensor seq_start, "
        "Tensor cu_rows, float scale) -> Tensor",
        ragged_attention);
}
