// PyTorch binding of the verification kernels (the kernels themselves, in verify_kernels.cu, include no PyTorch
// headers). Built on demand by cascade/verify/native.py through torch.utils.cpp_extension, for ROCm or CUDA.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "verify_kernels.h"

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be on a GPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == 0, what, " failed to launch: ", cascade_error_string(static_cast<cascade_error_t>(error)));
}

// The draft rows of a sampling op (null for one-hot drafts), after checking every float input it reads.
struct DraftRows {
  const float* data = nullptr;
  int64_t stride = 0;
};

DraftRows sampling_inputs(const c10::optional<torch::Tensor>& draft_probs, const torch::Tensor& target_probs,
                          const torch::Tensor& uniforms, const torch::Tensor& final_uniforms) {
  check(target_probs, "target_probs", torch::kFloat32);
  check(uniforms, "uniforms", torch::kFloat32);
  check(final_uniforms, "final_uniforms", torch::kFloat32);
  DraftRows rows;
  if (draft_probs.has_value()) {
    check(*draft_probs, "draft_probs", torch::kFloat32);
    rows = {draft_probs->data_ptr<float>(), draft_probs->stride(0)};
  }
  return rows;
}

torch::Tensor argmax_rows(torch::Tensor rows) {  // [num_rows, vocab] float32 -> [num_rows] int64
  check(rows, "rows", torch::kFloat32);
  const c10::cuda::CUDAGuard guard(rows.device());
  auto out = torch::empty({rows.size(0)}, rows.options().dtype(torch::kInt64));
  check_launch(cascade::launch_argmax_rows(rows.data_ptr<float>(), rows.size(0), rows.size(1), rows.stride(0),
                                           out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "argmax_rows");
  return out;
}

std::vector<torch::Tensor> greedy_accept(torch::Tensor drafts, torch::Tensor cu, torch::Tensor target_argmax,
                                         int64_t max_depth) {
  check(drafts, "draft_token_ids", torch::kInt64);
  check(cu, "cu_num_draft_tokens", torch::kInt64);
  check(target_argmax, "target_argmax", torch::kInt64);
  const c10::cuda::CUDAGuard guard(cu.device());
  const int64_t batch = cu.size(0) - 1;
  auto output = torch::empty({batch, max_depth + 1}, cu.options());
  auto num_accepted = torch::empty({batch}, cu.options());
  check_launch(cascade::launch_greedy_accept(drafts.data_ptr<int64_t>(), cu.data_ptr<int64_t>(),
                                             target_argmax.data_ptr<int64_t>(), batch, max_depth,
                                             output.data_ptr<int64_t>(), num_accepted.data_ptr<int64_t>(),
                                             c10::cuda::getCurrentCUDAStream()),
               "greedy_accept");
  return {output, num_accepted};
}

std::vector<torch::Tensor> sampling(torch::Tensor drafts, torch::Tensor cu, c10::optional<torch::Tensor> draft_probs,
                                    torch::Tensor target_probs, torch::Tensor uniforms, torch::Tensor final_uniforms,
                                    int64_t max_depth) {
  check(drafts, "draft_token_ids", torch::kInt64);
  check(cu, "cu_num_draft_tokens", torch::kInt64);
  const DraftRows q = sampling_inputs(draft_probs, target_probs, uniforms, final_uniforms);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t batch = cu.size(0) - 1;
  auto output = torch::empty({batch, max_depth + 1}, cu.options());
  auto num_accepted = torch::empty({batch}, cu.options());
  check_launch(cascade::launch_sampling(drafts.data_ptr<int64_t>(), cu.data_ptr<int64_t>(), q.data,
                                        target_probs.data_ptr<float>(), uniforms.data_ptr<float>(),
                                        final_uniforms.data_ptr<float>(), batch, target_probs.size(1), max_depth,
                                        q.stride, target_probs.stride(0), output.data_ptr<int64_t>(),
                                        num_accepted.data_ptr<int64_t>(),
                                        c10::cuda::getCurrentCUDAStream()),
               "sampling");
  return {output, num_accepted};
}

std::vector<torch::Tensor> tree_outputs(const torch::Tensor& cu, int64_t max_nodes) {
  const int64_t batch = cu.size(0) - 1;
  return {torch::full({batch, max_nodes}, -1, cu.options()), torch::empty({batch}, cu.options()),
          torch::empty({batch}, cu.options())};
}

std::vector<torch::Tensor> tree_matching(torch::Tensor tokens, torch::Tensor parents, torch::Tensor cu,
                                         torch::Tensor chosen, int64_t max_nodes) {
  check(tokens, "tokens", torch::kInt64);
  check(parents, "parents", torch::kInt64);
  check(cu, "cu_num_nodes", torch::kInt64);
  check(chosen, "chosen", torch::kInt64);
  const c10::cuda::CUDAGuard guard(cu.device());
  auto out = tree_outputs(cu, max_nodes);
  check_launch(cascade::launch_tree_matching(tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                                             cu.data_ptr<int64_t>(), chosen.data_ptr<int64_t>(), cu.size(0) - 1,
                                             max_nodes, out[0].data_ptr<int64_t>(), out[1].data_ptr<int64_t>(),
                                             out[2].data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "tree_matching");
  return out;
}

std::vector<torch::Tensor> tree_sampling(torch::Tensor tokens, torch::Tensor parents, torch::Tensor sampled,
                                         torch::Tensor cu, c10::optional<torch::Tensor> draft_probs,
                                         torch::Tensor target_probs, torch::Tensor uniforms,
                                         torch::Tensor final_uniforms, int64_t max_nodes) {
  check(tokens, "tokens", torch::kInt64);
  check(parents, "parents", torch::kInt64);
  check(sampled, "sampled", torch::kUInt8);
  check(cu, "cu_num_nodes", torch::kInt64);
  const DraftRows q = sampling_inputs(draft_probs, target_probs, uniforms, final_uniforms);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t batch = cu.size(0) - 1;
  auto out = tree_outputs(cu, max_nodes);
  auto scratch = torch::empty({batch, target_probs.size(1)}, target_probs.options());
  check_launch(cascade::launch_tree_sampling(
                   tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(), sampled.data_ptr<uint8_t>(),
                   cu.data_ptr<int64_t>(), q.data, target_probs.data_ptr<float>(), uniforms.data_ptr<float>(),
                   final_uniforms.data_ptr<float>(), batch, target_probs.size(1), max_nodes, q.stride,
                   target_probs.stride(0), scratch.data_ptr<float>(), out[0].data_ptr<int64_t>(),
                   out[1].data_ptr<int64_t>(), out[2].data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
               "tree_sampling");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "rows.argmax(-1), ties to the lowest index");
  m.def("greedy_accept", &greedy_accept, "greedy verification from the target's argmax ids");
  m.def("sampling", &sampling, "speculative sampling verification");
  m.def("tree_matching", &tree_matching, "draft trees: the path the verifier's own tokens follow");
  m.def("tree_sampling", &tree_sampling, "draft trees: recursive rejection sampling over siblings");
}
