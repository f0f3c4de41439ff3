// Op schemas (mutated arguments marked) and the CPU registrations. The CUDA kernels register
// under the same schemas in cuda/ops.cpp when the extension is built with CUDA.
// num_keys and hot_base are Scalars, not ints: torch converts a Python bool passed for an `int`
// to 0 or 1 before any kernel sees it, while a Scalar keeps its type, so the shared validator
// can refuse a bool (or a float) by name.
#include <Python.h>
#include <torch/library.h>

#include "hisparse_limits.h"
#include "ops.h"

TORCH_LIBRARY(hisparse, m) {
  m.def(
      "hisparse_resolve_residency(Tensor top_k, Tensor state_rows, Tensor? resident_rows, "
      "Tensor(a!) slot_keys, Tensor(b!) lru, Tensor(c!) stats, Tensor(d!) out_rows, "
      "Tensor(e!) miss_src, Tensor(f!) miss_dst, Tensor(g!) miss_count, Scalar num_keys, "
      "Scalar hot_base) -> ()");
  m.def(
      "hisparse_gather(Tensor[] host, Tensor(a!)[] hot, Tensor miss_src, Tensor miss_dst, "
      "Tensor miss_count, Tensor(b!)? moved_bytes) -> ()");
  m.def(
      "hisparse_invalidate(Tensor(a!) slot_keys, Tensor(b!) lru, Tensor state_rows, "
      "Tensor? keys) -> ()");
  m.def(
      "hisparse_save_rows(Tensor[] src, Tensor(a!)[] host, Tensor src_rows, Tensor host_rows, "
      "Tensor(b!)? moved_bytes) -> ()");
  m.def(
      "hisparse_topk_slots(Tensor scores, Tensor req, Tensor block_table, Scalar block_size, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(hisparse, CPU, m) {
  m.impl("hisparse_resolve_residency", &hisparse::resolve_residency_cpu);
  m.impl("hisparse_gather", &hisparse::gather_cpu);
  m.impl("hisparse_invalidate", &hisparse::invalidate_cpu);
  m.impl("hisparse_save_rows", &hisparse::save_rows_cpu);
  m.impl("hisparse_topk_slots", &hisparse::topk_slots_cpu);
}

// A plain Python module so `import hisparse._C` loads the library and its registrations.
static PyModuleDef hisparse_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&hisparse_module);
  if (mod == nullptr) return nullptr;
#ifdef HISPARSE_WITH_CUDA
  PyModule_AddIntConstant(mod, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(mod, "WITH_CUDA", 0);
#endif
  // The build's own limits, so hisparse/limits.py can refuse to run next to a stale extension.
  if (PyModule_AddIntConstant(mod, "MAX_HOT_SIZE", hisparse::kMaxHotSize) < 0 ||
      PyModule_AddIntConstant(mod, "INT32_MAX", hisparse::kInt32Max) < 0 ||
      PyModule_AddIntConstant(mod, "ROW_ALIGN", hisparse::kRowAlign) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
