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
  check(target_probs, "target_probs", torch::kFloat32);
  check(uniforms, "uniforms", torch::kFloat32);
  check(final_uniforms, "final_uniforms", torch::kFloat32);
  const float* q = nullptr;
  int64_t stride_q = 0;
  if (draft_probs.has_value()) {
    check(*draft_probs, "draft_probs", torch::kFloat32);
    q = draft_probs->data_ptr<float>();
    stride_q = draft_probs->stride(0);
  }
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const int64_t batch = cu.size(0) - 1;
  auto output = torch::empty({batch, max_depth + 1}, cu.options());
  auto num_accepted = torch::empty({batch}, cu.options());
  check_launch(cascade::launch_sampling(drafts.data_ptr<int64_t>(), cu.data_ptr<int64_t>(), q,
                                        target_probs.data_ptr<float>(), uniforms.data_ptr<float>(),
                                        final_uniforms.data_ptr<float>(), batch, target_probs.size(1), max_depth,
                                        stride_q, target_probs.stride(0), output.data_ptr<int64_t>(),
                                        num_accepted.data_ptr<int64_t>(),
                                        c10::cuda::getCurrentCUDAStream()),
               "sampling");
  return {output, num_accepted};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "rows.argmax(-1), ties to the lowest index");
  m.def("greedy_accept", &greedy_accept, "greedy verification from the target's argmax ids");
  m.def("sampling", &sampling, "speculative sampling verification");
}
