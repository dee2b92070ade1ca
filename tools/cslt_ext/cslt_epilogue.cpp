// A cuSPARSELt 2:4 matmul with its epilogue under our control: a host scalar alpha (no device
// read, so CUDA graphs capture it; torch's binding takes a one-element alpha only as a CUDA
// tensor read with .item()), a bias, and cuSPARSELt's GELU. Prototype for issue 14 (the fp8
// scale/bias/activation inside the GEMM), built and checked on the GPU by
// tools/probe_cslt_epilogue.py; not used by the package.
//
//   out (M, N) = act(alpha * x (M, K) @ W.T + bias)            (bf16 / fp16 / fp32 out)
//   out (M, N) = fp8(d_scale * act(alpha * x @ W.T + bias))    (fp8 out, d_scale given)
//
// W (N, K) is the weight compressed by torch._cslt_compress (the same structured descriptor:
// N rows, K columns, leading dimension K, row-major, alignment 16), x row-major contiguous.
// The descriptors mirror torch's _cslt_sparse_mm with transpose_result=True.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cusparseLt.h>
#include <torch/extension.h>

#include <optional>
#include <string>

namespace {

thread_local cusparseLtHandle_t handle;
thread_local bool handle_ready = false;

void check(cusparseStatus_t status, const char* what) {
  TORCH_CHECK(status == CUSPARSE_STATUS_SUCCESS, "cuSPARSELt: ", what, " failed with status ",
              static_cast<int>(status));
}

cudaDataType input_type(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::BFloat16: return CUDA_R_16BF;
    case at::ScalarType::Float8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::ScalarType::Char: return CUDA_R_8I;
    default: TORCH_CHECK(false, "x must be bfloat16, float8_e4m3fn or int8, got ", t);
  }
}

cudaDataType output_type(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::BFloat16: return CUDA_R_16BF;
    case at::ScalarType::Half: return CUDA_R_16F;
    case at::ScalarType::Float: return CUDA_R_32F;
    case at::ScalarType::Float8_e4m3fn: return CUDA_R_8F_E4M3;
    default: TORCH_CHECK(false, "out_dtype must be bfloat16, float16, float32 or float8_e4m3fn");
  }
}

}  // namespace

at::Tensor sparse24_mm_epilogue(const at::Tensor& packed, const at::Tensor& x, int64_t n,
                                const std::optional<at::Tensor>& bias, double alpha, bool gelu,
                                at::ScalarType out_dtype, int64_t alg_id,
                                const std::optional<at::Tensor>& d_scale) {
  TORCH_CHECK(x.is_cuda() && packed.is_cuda(), "x and packed must be CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (M, K) matrix");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "packed and x must share a dtype");
  if (!handle_ready) {
    check(cusparseLtInit(&handle), "init");
    handle_ready = true;
  }
  const int64_t m = x.size(0), k = x.size(1);
  const cudaDataType in_t = input_type(x.scalar_type());
  const cudaDataType out_t = output_type(out_dtype);
  // the C matrix (beta = 0, never read) may not be fp8: fp16 as torch does
  const cudaDataType c_t = out_t == CUDA_R_8F_E4M3 ? CUDA_R_16F : out_t;
  const cusparseComputeType compute =
      in_t == CUDA_R_8I ? CUSPARSE_COMPUTE_32I : CUSPARSE_COMPUTE_32F;

  cusparseLtMatDescriptor_t a_desc, b_desc, c_desc, d_desc;
  check(cusparseLtStructuredDescriptorInit(&handle, &a_desc, n, k, k, 16, in_t,
                                           CUSPARSE_ORDER_ROW, CUSPARSELT_SPARSITY_50_PERCENT),
        "sparse descriptor");
  // x (M, K) row-major, used transposed: B = x.T (K, M)
  check(cusparseLtDenseDescriptorInit(&handle, &b_desc, m, k, k, 16, in_t, CUSPARSE_ORDER_ROW),
        "dense descriptor");
  // D = W @ x.T (N, M) column-major with leading dimension N: out (M, N) row-major in memory
  check(cusparseLtDenseDescriptorInit(&handle, &c_desc, n, m, n, 16, c_t, CUSPARSE_ORDER_COL),
        "C descriptor");
  check(cusparseLtDenseDescriptorInit(&handle, &d_desc, n, m, n, 16, out_t, CUSPARSE_ORDER_COL),
        "D descriptor");
  cusparseLtMatmulDescriptor_t matmul;
  check(cusparseLtMatmulDescriptorInit(&handle, &matmul, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                       CUSPARSE_OPERATION_TRANSPOSE, &a_desc, &b_desc, &c_desc,
                                       &d_desc, compute),
        "matmul descriptor");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->numel() == n, "bias must be a CUDA vector of N values");
    void* ptr = bias->data_ptr();
    check(cusparseLtMatmulDescSetAttribute(&handle, &matmul, CUSPARSELT_MATMUL_BIAS_POINTER,
                                           &ptr, sizeof(ptr)),
          "bias pointer");
  }
  if (gelu) {
    int on = 1;
    check(cusparseLtMatmulDescSetAttribute(&handle, &matmul, CUSPARSELT_MATMUL_ACTIVATION_GELU,
                                           &on, sizeof(on)),
          "GELU activation");
  }
  if (d_scale.has_value()) {
    // fp8 out: D = fp8(d_scale * act(alpha * A @ B + bias)) (the next layer's static input
    // quantization, 1 / its scale, read on the device at run time: capturable)
    TORCH_CHECK(d_scale->is_cuda() && d_scale->numel() == 1 &&
                    d_scale->scalar_type() == at::ScalarType::Float,
                "d_scale must be a one-element float32 CUDA tensor");
    int mode = CUSPARSELT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    check(cusparseLtMatmulDescSetAttribute(&handle, &matmul, CUSPARSELT_MATMUL_D_SCALE_MODE,
                                           &mode, sizeof(mode)),
          "D scale mode");
    void* ptr = d_scale->data_ptr();
    check(cusparseLtMatmulDescSetAttribute(&handle, &matmul, CUSPARSELT_MATMUL_D_SCALE_POINTER,
                                           &ptr, sizeof(ptr)),
          "D scale pointer");
  }
  cusparseLtMatmulAlgSelection_t alg_sel;
  check(cusparseLtMatmulAlgSelectionInit(&handle, &alg_sel, &matmul,
                                         CUSPARSELT_MATMUL_ALG_DEFAULT),
        "algorithm selection");
  int alg = static_cast<int>(alg_id);
  check(cusparseLtMatmulAlgSetAttribute(&handle, &alg_sel, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &alg,
                                        sizeof(alg)),
        "algorithm id");
  cusparseLtMatmulPlan_t plan;
  check(cusparseLtMatmulPlanInit(&handle, &plan, &matmul, &alg_sel), "plan");
  size_t workspace_size = 0;
  check(cusparseLtMatmulGetWorkspace(&handle, &plan, &workspace_size), "workspace size");
  auto& allocator = *c10::cuda::CUDACachingAllocator::get();
  auto workspace = allocator.allocate(workspace_size);
  auto out = at::empty({m, n}, x.options().dtype(out_dtype));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float alpha_f = static_cast<float>(alpha), beta_f = 0.0f;
  check(cusparseLtMatmul(&handle, &plan, &alpha_f, packed.data_ptr(), x.data_ptr(), &beta_f,
                         out.data_ptr(), out.data_ptr(), workspace.get(), &stream, 1),
        "matmul");
  cusparseLtMatmulPlanDestroy(&plan);
  cusparseLtMatDescriptorDestroy(&a_desc);
  cusparseLtMatDescriptorDestroy(&b_desc);
  cusparseLtMatDescriptorDestroy(&c_desc);
  cusparseLtMatDescriptorDestroy(&d_desc);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse24_mm_epilogue", &sparse24_mm_epilogue,
        "act(alpha * x @ W.T + bias) on cuSPARSELt 2:4 (W compressed by torch._cslt_compress)",
        pybind11::arg("packed"), pybind11::arg("x"), pybind11::arg("n"), pybind11::arg("bias"),
        pybind11::arg("alpha"), pybind11::arg("gelu"), pybind11::arg("out_dtype"),
        pybind11::arg("alg_id"), pybind11::arg("d_scale") = pybind11::none());
}
