// The check ops of the GPU ops' device reports (TfTtemb>CheckBagReport,
// CheckGroupReport, CheckTTRowsReport). A GPU op that must not wait for the device
// (a forward, GroupBags, TTRows) writes what it found wrong in its inputs to a
// `report` output; the check op beside it raises the CPU kernel's InvalidArgument from
// that report. Each report's Traits, written once here for both devices, give
//   using Report = ...; using Attrs = ...;
//   static Status GetAttrs(OpKernelConstruction*, Attrs*);
//   static Status Validate(const Tensor& report, bool* empty);  // empty: a CPU op's
//   static Status Check(const Report&, const Attrs&);
// CheckReportCpuOp<Traits> (here) is the CPU kernel, for a report TensorFlow copied
// to the host (or a CPU op's empty one); CheckReportGpuOp<Traits> (gpu_kernel_util.h)
// the GPU kernel, which finishes from the EventMgr. The family's *_cpu.cc / *_gpu.cc
// register them.

#ifndef TF_TTEMB_CC_KERNELS_CHECK_REPORT_OP_H_
#define TF_TTEMB_CC_KERNELS_CHECK_REPORT_OP_H_

#include <cstdint>
#include <cstring>

#include "cc/kernels/gather_reduce_sum_kernels.h"
#include "cc/kernels/grouped_bags_kernels.h"
#include "cc/kernels/tt_embedding_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
namespace tf_ttemb {

// A GatherReduceSum forward's report (DeviceReport), with its bag attrs.
struct BagReportTraits {
  using Report = DeviceReport;
  using Attrs = BagAttrs;
  static Status GetAttrs(OpKernelConstruction* ctx, BagAttrs* attrs) {
    return GetReportAttrs(ctx, attrs);
  }
  static Status Validate(const Tensor& report, bool* empty) {
    return ValidateReportInput(report, empty);
  }
  static Status Check(const DeviceReport& r, const BagAttrs& attrs) {
    return ReportStatus(r, attrs);
  }
};

// A GroupBags report (GroupReport), with the features' attrs.
struct GroupReportTraits {
  using Report = GroupReport;
  using Attrs = GroupAttrs;
  static Status GetAttrs(OpKernelConstruction* ctx, GroupAttrs* attrs) {
    return GetGroupAttrs(ctx, /*with_weights=*/false, attrs);
  }
  static Status Validate(const Tensor& report, bool* empty) {
    return ValidateGroupReportInput(report, empty);
  }
  static Status Check(const GroupReport& r, const GroupAttrs& attrs) {
    return GroupReportStatus(r, attrs);
  }
};

// A TTRows report (TTReport), with the bound of the global ids.
struct TTRowsReportTraits {
  using Report = TTReport;
  using Attrs = int64_t;  // valid global ids are [0, limit)
  static Status GetAttrs(OpKernelConstruction* ctx, int64_t* limit) {
    return GetTTRowsReportAttrs(ctx, limit);
  }
  static Status Validate(const Tensor& report, bool* empty) {
    return ValidateTTReportInput(report, empty);
  }
  static Status Check(const TTReport& r, const int64_t& limit) {
    return GlobalIdsReportStatus(r, limit);
  }
};

template <typename Traits>
class CheckReportCpuOp : public OpKernel {
 public:
  explicit CheckReportCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, Traits::GetAttrs(ctx, &attrs_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& report = ctx->input(0);
    bool empty = false;
    OP_REQUIRES_OK(ctx, Traits::Validate(report, &empty));
    if (empty) return;
    typename Traits::Report r;
    std::memcpy(&r, report.flat<int64_t>().data(), sizeof(r));
    OP_REQUIRES_OK(ctx, Traits::Check(r, attrs_));
  }

 private:
  typename Traits::Attrs attrs_;
};

}  // namespace tf_ttemb
}  // namespace tensorflow

#endif  // TF_TTEMB_CC_KERNELS_CHECK_REPORT_OP_H_
