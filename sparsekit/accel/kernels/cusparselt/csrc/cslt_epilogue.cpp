// sparsekit's own cuSPARSELt 2:4 matmul, for what torch's binding (torch._cslt_sparse_mm) cannot
// do under CUDA graphs: a host scalar alpha (torch's takes a one-element alpha only as a CUDA
// tensor read with .item(), a device sync), and cuSPARSELt's GELU in the epilogue.
//
//   out (M, N) bf16 = act(alpha * x (M, K) @ W.T + bias)
//
// x is float8 e4m3fn or int8 (row-major, contiguous); W (N, K) the weight compressed by
// torch._cslt_compress (the same structured descriptor: N rows, K columns, leading dimension K,
// row-major, alignment 16); bias bf16 (N,) or none. The descriptors mirror torch's binding with
// transpose_result=True. bf16/fp16 inputs are refused: cuSPARSELt 0.8.0 crashes (a host
// segfault) on a 16-bit input with the GELU epilogue, and torch's binding already takes bias.
// Built ahead of time by `python -m sparsekit.accel.build` (sparsekit/accel/build/); the
// plan of each (shape, epilogue, algorithm) is made once and kept, so a call costs one
// cusparseLtMatmul.
//
// Errors are not thrown: a failing call returns None and last_error() says why (the Python
// wrapper raises it). A C++ exception thrown out of this extension crashed the process on the
// H200 image (torch 2.11), where an algorithm id past the last one must be an error the
// algorithm search stops at.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cusparseLt.h>
#include <torch/extension.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace {

thread_local std::string last_error_message;

bool fail(const std::string& message) {
  last_error_message = message;
  return false;
}

bool ok(cusparseStatus_t status, const char* what) {
  if (status == CUSPARSE_STATUS_SUCCESS) return true;
  return fail(std::string("cuSPARSELt: ") + what + " failed with status " +
              std::to_string(static_cast<int>(status)));
}

cusparseLtHandle_t* handle() {
  static cusparseLtHandle_t h;
  static bool ready = false;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (!ready) ready = ok(cusparseLtInit(&h), "init");
  return ready ? &h : nullptr;
}

// One matmul plan: descriptors and plan live as long as the process (a few per layer shape).
struct Plan {
  cusparseLtMatDescriptor_t a, b, c;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t alg_sel;
  cusparseLtMatmulPlan_t plan;
  size_t workspace = 0;
};

// device, M, N, K, input dtype, bias pointer, GELU, algorithm
using Key = std::tuple<int, int64_t, int64_t, int64_t, int, const void*, bool, int64_t>;

std::mutex plans_mutex;
std::map<Key, std::unique_ptr<Plan>> plans;

Plan* plan_for(const Key& key, cudaDataType in_t, const void* bias, bool gelu, int alg) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto found = plans.find(key);
  if (found != plans.end()) return found->second.get();
  cusparseLtHandle_t* h = handle();
  if (h == nullptr) return nullptr;
  const int64_t m = std::get<1>(key), n = std::get<2>(key), k = std::get<3>(key);
  auto p = std::make_unique<Plan>();
  const cusparseComputeType compute =
      in_t == CUDA_R_8I ? CUSPARSE_COMPUTE_32I : CUSPARSE_COMPUTE_32F;
  void* bias_ptr = const_cast<void*>(bias);
  int on = 1, max_alg = 0;
  const bool built =
      ok(cusparseLtStructuredDescriptorInit(h, &p->a, n, k, k, 16, in_t, CUSPARSE_ORDER_ROW,
                                            CUSPARSELT_SPARSITY_50_PERCENT),
         "sparse descriptor") &&
      // x (M, K) row-major, used transposed: B = x.T (K, M)
      ok(cusparseLtDenseDescriptorInit(h, &p->b, m, k, k, 16, in_t, CUSPARSE_ORDER_ROW),
         "dense descriptor") &&
      // D = W @ x.T (N, M) column-major, leading dimension N: out (M, N) row-major in memory
      ok(cusparseLtDenseDescriptorInit(h, &p->c, n, m, n, 16, CUDA_R_16BF, CUSPARSE_ORDER_COL),
         "output descriptor") &&
      ok(cusparseLtMatmulDescriptorInit(h, &p->matmul, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                        CUSPARSE_OPERATION_TRANSPOSE, &p->a, &p->b, &p->c, &p->c,
                                        compute),
         "matmul descriptor") &&
      (bias == nullptr ||
       ok(cusparseLtMatmulDescSetAttribute(h, &p->matmul, CUSPARSELT_MATMUL_BIAS_POINTER,
                                           &bias_ptr, sizeof(bias_ptr)),
          "bias pointer")) &&
      (!gelu || ok(cusparseLtMatmulDescSetAttribute(h, &p->matmul,
                                                    CUSPARSELT_MATMUL_ACTIVATION_GELU, &on,
                                                    sizeof(on)),
                   "GELU activation")) &&
      ok(cusparseLtMatmulAlgSelectionInit(h, &p->alg_sel, &p->matmul,
                                          CUSPARSELT_MATMUL_ALG_DEFAULT),
         "algorithm selection") &&
      // past the last algorithm: an error (the search stops there), never a plan to run
      ok(cusparseLtMatmulAlgGetAttribute(h, &p->alg_sel, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID,
                                         &max_alg, sizeof(max_alg)),
         "algorithm count") &&
      (alg >= 0 && alg <= max_alg
           ? true
           : fail("cuSPARSELt: algorithm id " + std::to_string(alg) + " out of range 0.." +
                  std::to_string(max_alg))) &&
      ok(cusparseLtMatmulAlgSetAttribute(h, &p->alg_sel, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &alg,
                                         sizeof(alg)),
         "algorithm id") &&
      ok(cusparseLtMatmulPlanInit(h, &p->plan, &p->matmul, &p->alg_sel), "plan") &&
      ok(cusparseLtMatmulGetWorkspace(h, &p->plan, &p->workspace), "workspace size");
  if (!built) return nullptr;
  return plans.emplace(key, std::move(p)).first->second.get();
}

}  // namespace

at::Tensor sparse24_mm_alpha(const at::Tensor& packed, const at::Tensor& x, int64_t n,
                             const std::optional<at::Tensor>& bias, double alpha, bool gelu,
                             int64_t alg_id) {
  cudaDataType in_t = CUDA_R_8F_E4M3;
  if (x.scalar_type() == at::ScalarType::Char) in_t = CUDA_R_8I;
  const bool args_ok =
      (x.is_cuda() && packed.is_cuda() ? true : fail("x and packed must be CUDA tensors")) &&
      (x.dim() == 2 && x.is_contiguous() ? true : fail("x must be a contiguous (M, K) matrix")) &&
      (packed.scalar_type() == x.scalar_type() ? true
                                                : fail("packed and x must share a dtype")) &&
      (x.scalar_type() == at::ScalarType::Float8_e4m3fn || x.scalar_type() == at::ScalarType::Char
           ? true
           : fail("x must be float8_e4m3fn or int8")) &&
      (!bias.has_value() || (bias->is_cuda() && bias->numel() == n && bias->is_contiguous() &&
                             bias->scalar_type() == at::ScalarType::BFloat16)
           ? true
           : fail("bias must be a contiguous bfloat16 CUDA vector of N values"));
  if (!args_ok) return at::Tensor();
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  const int64_t m = x.size(0), k = x.size(1);
  const Key key{x.get_device(), m, n, k, static_cast<int>(in_t), bias_ptr, gelu, alg_id};
  Plan* p = plan_for(key, in_t, bias_ptr, gelu, static_cast<int>(alg_id));
  if (p == nullptr) return at::Tensor();
  auto workspace = c10::cuda::CUDACachingAllocator::get()->allocate(p->workspace);
  auto out = at::empty({m, n}, x.options().dtype(at::ScalarType::BFloat16));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float alpha_f = static_cast<float>(alpha), beta_f = 0.0f;
  if (!ok(cusparseLtMatmul(handle(), &p->plan, &alpha_f, packed.data_ptr(), x.data_ptr(), &beta_f,
                           out.data_ptr(), out.data_ptr(), workspace.get(), &stream, 1),
          "matmul"))
    return at::Tensor();
  return out;
}

std::string last_error() { return last_error_message; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse24_mm_alpha", &sparse24_mm_alpha,
        "bf16 act(alpha * x @ W.T + bias) on cuSPARSELt 2:4 (W compressed by "
        "torch._cslt_compress); None on failure (last_error says why)",
        pybind11::arg("packed"), pybind11::arg("x"), pybind11::arg("n"), pybind11::arg("bias"),
        pybind11::arg("alpha"), pybind11::arg("gelu"), pybind11::arg("alg_id"));
  m.def("last_error", &last_error, "why the last failing call returned None");
}
