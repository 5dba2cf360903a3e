// The check ops of the GPU ops' device reports (TfTtemb>CheckBagReport,
// CheckGroupReport, CheckTTRowsReport). A GPU op that must not wait for the device
// (a forward, GroupBags, TTRows) writes what it found wrong in its inputs to a
// `report` output; the check op beside it raises the CPU kernel's InvalidArgument from
// that report. Each report's Traits (ReportTraits), written once here for both
// devices, give
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

// The Traits of a report type: its attrs' parser, its input check and the
// status it turns a report into, each a function of the report's family.
template <typename ReportT, typename AttrsT, auto kGetAttrs, auto kValidate, auto kCheck>
struct ReportTraits {
  using Report = ReportT;
  using Attrs = AttrsT;
  static Status GetAttrs(OpKernelConstruction* ctx, Attrs* attrs) { return kGetAttrs(ctx, attrs); }
  static Status Validate(const Tensor& report, bool* empty) { return kValidate(report, empty); }
  static Status Check(const Report& r, const Attrs& attrs) { return kCheck(r, attrs); }
};

// CheckGroupReport's attrs: the features' (no weights).
inline Status GetGroupReportAttrs(OpKernelConstruction* ctx, GroupAttrs* attrs) {
  return GetGroupAttrs(ctx, /*with_weights=*/false, attrs);
}

// A GatherReduceSum forward's report (DeviceReport), with its bag attrs.
using BagReportTraits =
    ReportTraits<DeviceReport, BagAttrs, &GetReportAttrs, &ValidateReportInput, &ReportStatus>;
// A GroupBags report (GroupReport), with the features' attrs.
using GroupReportTraits = ReportTraits<GroupReport, GroupAttrs, &GetGroupReportAttrs,
                                       &ValidateGroupReportInput, &GroupReportStatus>;
// A TTRows report (TTReport), with the bound of the global ids: valid ones are [0, limit).
using TTRowsReportTraits = ReportTraits<TTReport, int64_t, &GetTTRowsReportAttrs,
                                        &ValidateTTReportInput, &GlobalIdsReportStatus>;

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
