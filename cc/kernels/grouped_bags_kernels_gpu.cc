// The GPU glue of the grouped_bags family: GroupBagsLaunch<GpuDevice>, which
// queues cuda/grouped_bags_kernels.cu's launcher on the op's stream and
// returns without waiting (its findings in the `report` output), and
// CheckGroupReport's GPU kernel (CheckReportGpuOp), which finishes from the
// EventMgr with the CPU kernel's InvalidArgument for what the report holds.

#if GOOGLE_CUDA

#include <cstdint>
#include <utility>
#include <vector>

#include "cc/kernels/check_report_op.h"
#include "cc/kernels/gpu_kernel_util.h"
#include "cc/kernels/grouped_bags_kernels.h"
#include "cuda/grouped_bags_kernels.cuh"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace tf_ttemb {

namespace launchers = ::tf_ttemb::gpu;

template <typename T, typename Tindex>
struct GroupBagsLaunch<GpuDevice, T, Tindex> {
  static constexpr int64_t kReportWords = kGroupReportWords;

  static Status Run(OpKernelContext* ctx, const GroupAttrs& attrs, const GroupArgs& a) {
    using CT = typename CudaTypeOf<T>::type;
    cudaStream_t stream = nullptr;
    TF_RETURN_IF_ERROR(OpCudaStream(ctx, &stream));
    // The features' attrs, the parts' starts and the parts' addresses, in one copy
    // to the device per call (CopyWordsToDevice: queued, not waited for).
    const int64_t num_features = attrs.num_features();
    const int64_t num_parts = static_cast<int64_t>(a.indices.size());
    std::vector<int64_t> packed;
    packed.reserve(4 * num_features + 2 * num_parts + 1);
    packed.insert(packed.end(), attrs.num_rows.begin(), attrs.num_rows.end());
    packed.insert(packed.end(), attrs.row_offsets.begin(), attrs.row_offsets.end());
    packed.insert(packed.end(), attrs.padding_ids.begin(), attrs.padding_ids.end());
    for (bool pads : attrs.has_padding_ids) packed.push_back(pads ? 1 : 0);
    packed.insert(packed.end(), a.part_starts.begin(), a.part_starts.end());
    for (const Tensor* part : a.indices) {
      packed.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(part->data())));
    }
    Tensor device;
    TF_RETURN_IF_ERROR(CopyWordsToDevice(ctx, stream, packed, &device));
    const int64_t* words = device.flat<int64_t>().data();
    launchers::GroupProblem p;
    p.num_features = num_features;
    p.batch = a.batch;
    p.nnz = a.nnz;
    p.features = words;
    p.num_parts = num_parts;
    p.part_starts = words + 4 * num_features;
    const auto* parts = reinterpret_cast<const Tindex* const*>(p.part_starts + num_parts + 1);
    const size_t scratch_bytes = launchers::GroupBagsScratchBytes(p);
    Tensor scratch_tensor;
    void* scratch = nullptr;
    TF_RETURN_IF_ERROR(AllocateDeviceScratch(ctx, scratch_bytes, &scratch_tensor, &scratch));
    const bool weighted = attrs.has_weights;
    return CudaStatus(
        launchers::LaunchGroupBags<CT, Tindex>(
            p, parts, a.row_splits->flat<int64_t>().data(),
            weighted ? DevicePtr<T>(*a.weights) : nullptr, a.group_indices->flat<int64_t>().data(),
            a.group_row_splits->flat<int64_t>().data(),
            weighted ? DevicePtr<T>(a.group_weights) : nullptr,
            weighted ? a.positions->flat<int64_t>().data() : nullptr,
            reinterpret_cast<GroupReport*>(a.report->flat<int64_t>().data()), scratch,
            scratch_bytes, stream),
        "group bags launch");
  }
};

namespace {

// TfTtemb>CheckGroupReport on the GPU: finishes from the EventMgr once the
// stream has run GroupBags (CheckReportGpuOp, check_report_op.h).
REGISTER_KERNEL_BUILDER(Name("TfTtemb>CheckGroupReport").Device(DEVICE_GPU),
                        CheckReportGpuOp<GroupReportTraits>);

// row_splits in device memory like the ids: the GPU kernel checks them itself.
#define TF_TTEMB_REGISTER(T, Tindex)                               \
  REGISTER_KERNEL_BUILDER(Name("TfTtemb>GroupBags")                \
                              .Device(DEVICE_GPU)                  \
                              .TypeConstraint<T>("T")              \
                              .TypeConstraint<Tindex>("Tindices"), \
                          GroupBagsOp<GpuDevice, T, Tindex>);
#define TF_TTEMB_REGISTER_ALL_INDICES(T) TF_TTEMB_REGISTER(T, int32) TF_TTEMB_REGISTER(T, int64_t)
TF_TTEMB_REGISTER_ALL_INDICES(Eigen::half)
TF_TTEMB_REGISTER_ALL_INDICES(bfloat16)
TF_TTEMB_REGISTER_ALL_INDICES(float)
TF_TTEMB_REGISTER_ALL_INDICES(double)
#undef TF_TTEMB_REGISTER_ALL_INDICES
#undef TF_TTEMB_REGISTER

}  // namespace
}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // GOOGLE_CUDA
