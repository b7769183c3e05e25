// nanobind bindings of SchedulerCore: `nanocp.control_plane._core.SchedulerCore`, the same interface as
// control_plane/reference.py ReferenceCore. Routing tables and batch handles go to numpy without copies: each array
// owns (through a capsule) a reference to the C++ buffer it views. The arrays are made with numpy's C API (a
// lowering returns one per instance: a few hundred nanoseconds less each than going through numpy's Python API).
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL nanocp_core_numpy_api
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <numpy/arrayobject.h>

#include "bindings.h"
#include "scheduler.h"

namespace nanocp {
namespace {

using sched::SchedulerCore;
using sched::TableBuffer;

// Python's SchedulerError (a ValueError), so callers catch the same type from either core.
PyObject* scheduler_error_type() {
  static PyObject* type = nullptr;
  if (!type) {
    nb::object cls = nb::module_::import_("nanocp.control_plane.spec").attr("SchedulerError");
    type = cls.release().ptr();
  }
  return type;
}

void translate_exceptions(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const sched::SchedulerError& e) {
    PyErr_SetString(scheduler_error_type(), e.what());
  } catch (const sched::InvariantError& e) {
    PyErr_SetString(PyExc_AssertionError, e.what());
  } catch (const sched::UnknownHandle& e) {
    nb::object key = nb::int_(e.handle);
    PyErr_SetObject(PyExc_KeyError, key.ptr());
  }
}

// A 1-D numpy view of `size` elements at `data` (typenum: NPY_INT32 / NPY_INT64) that keeps `owner` alive.
nb::object numpy_view(void* data, size_t size, int typenum, const nb::object& owner) {
  npy_intp dims[1] = {npy_intp(size)};
  PyObject* array = PyArray_New(&PyArray_Type, 1, dims, typenum, nullptr, data, 0, NPY_ARRAY_CARRAY, nullptr);
  if (!array) throw nb::python_error();
  nb::object result = nb::steal(array);
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(array), owner.inc_ref().ptr()) < 0)
    throw nb::python_error();
  return result;
}

nb::capsule buffer_owner(const std::shared_ptr<TableBuffer>& buf) {
  auto* keep = new std::shared_ptr<TableBuffer>(buf);
  return nb::capsule(keep, [](void* q) noexcept { delete static_cast<std::shared_ptr<TableBuffer>*>(q); });
}

nb::object table_array(const std::shared_ptr<TableBuffer>& buf, size_t size) {
  return numpy_view(buf->data.get(), size, NPY_INT32, buffer_owner(buf));
}

// One view per instance into the pooled buffer, all sharing one owner.
nb::object lower_all(SchedulerCore& core, bool full) {
  std::vector<size_t> offsets;
  std::shared_ptr<TableBuffer> buf = core.lower_all(offsets, full);
  const nb::capsule owner = buffer_owner(buf);
  const size_t n = offsets.size() - 1;
  nb::list out = nb::steal<nb::list>(PyList_New(Py_ssize_t(n)));
  for (size_t i = 0; i < n; ++i) {
    nb::object view = numpy_view(buf->data.get() + offsets[i], offsets[i + 1] - offsets[i], NPY_INT32, owner);
    PyList_SET_ITEM(out.ptr(), Py_ssize_t(i), view.release().ptr());
  }
  return out;
}

// Every instance's table back to back in one array (one view, one owner) and the int64 offsets [n + 1] of the
// tables in it: what a driver that ships each table's bytes needs, without a Python object per instance.
nb::tuple lower_packed(SchedulerCore& core, bool full) {
  std::vector<size_t> offsets;
  std::shared_ptr<TableBuffer> buf = core.lower_all(offsets, full);
  nb::object tables = numpy_view(buf->data.get(), offsets.back(), NPY_INT32, buffer_owner(buf));
  npy_intp dims[1] = {npy_intp(offsets.size())};
  PyObject* bounds = PyArray_SimpleNew(1, dims, NPY_INT64);
  if (!bounds) throw nb::python_error();
  auto* at = static_cast<int64_t*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(bounds)));
  for (size_t i = 0; i < offsets.size(); ++i) at[i] = int64_t(offsets[i]);
  return nb::make_tuple(tables, nb::steal(bounds));
}

nb::object lower_one(SchedulerCore& core, int instance, bool full) {
  size_t size = 0;
  std::shared_ptr<TableBuffer> buf = core.lower(instance, size, full);
  return table_array(buf, size);
}

nb::object batch_handles(SchedulerCore& core) {
  auto* handles = new std::vector<int64_t>(core.batch_handles());
  nb::capsule owner(handles, [](void* q) noexcept { delete static_cast<std::vector<int64_t>*>(q); });
  return numpy_view(handles->data(), handles->size(), NPY_INT64, owner);
}

nb::list int_list(const std::vector<int64_t>& v) {
  nb::list out;
  for (int64_t x : v) out.append(x);
  return out;
}

nb::tuple loads(const SchedulerCore& core) {
  std::vector<int64_t> free(core.shape().num_instances);
  for (int i = 0; i < core.shape().num_instances; ++i) free[i] = core.free_frames(i);
  return nb::make_tuple(int_list(core.kv_tokens()), int_list(core.moe_batch()), int_list(core.num_shards()),
                        int_list(free));
}

nb::tuple request_info(SchedulerCore& core, int64_t handle) {
  const sched::Request& r = core.request(handle);
  return nb::make_tuple(r.prompt_len, r.max_new_tokens, core.decode_steps(r), int(r.status), r.moe);
}

nb::tuple binding(SchedulerCore& core, int64_t handle) {
  const sched::Request& r = core.request(handle);
  nb::list shards;
  for (int32_t k = 0; k < r.nshards; ++k) shards.append(nb::make_tuple(r.shard(k).instance, r.shard(k).tokens));
  return nb::make_tuple(r.moe, shards);
}

nb::list shard_pages(SchedulerCore& core, int64_t handle) {
  const sched::Request& r = core.request(handle);
  nb::list out;
  for (int32_t k = 0; k < r.nshards; ++k) {
    const sched::Shard& s = r.shard(k);
    nb::list frames;
    for (int32_t f : s.frames) frames.append(f);
    out.append(nb::make_tuple(s.instance, s.tokens, frames));
  }
  return out;
}

nb::list admitted(const SchedulerCore& core) {
  nb::list out;
  for (const auto& [handle, context, recompute] : core.last_admitted())
    out.append(nb::make_tuple(handle, context, recompute));
  return out;
}

}  // namespace

void bind_scheduler(nb::module_& m) {
  if (_import_array() < 0) throw nb::python_error();
  m.attr("CORE_VERSION") = 2;
  nb::register_exception_translator(translate_exceptions);
  nb::class_<SchedulerCore>(m, "SchedulerCore",
                            "C++ decode control-plane core; same interface and decisions as ReferenceCore.")
      .def(
          "__init__",
          [](SchedulerCore* self, int64_t num_nodes, int64_t instances_per_node, int64_t kv_capacity_tokens,
             int64_t page_size, const std::string& policy, const std::vector<int64_t>& cp_max_lens,
             const std::vector<int64_t>& cp_cps, int64_t max_batch_per_instance) {
            const std::string policy_repr = nb::repr(nb::str(policy.c_str(), policy.size())).c_str();
            new (self) SchedulerCore(num_nodes, instances_per_node, kv_capacity_tokens, page_size, policy,
                                     policy_repr, cp_max_lens, cp_cps, max_batch_per_instance);
          },
          nb::arg("num_nodes"), nb::arg("instances_per_node"), nb::arg("kv_capacity_tokens"), nb::arg("page_size"),
          nb::arg("policy"), nb::arg("cp_max_lens"), nb::arg("cp_cps"), nb::arg("max_batch_per_instance") = 0)
      .def("add_request", &SchedulerCore::add_request, nb::arg("handle"), nb::arg("prompt_len"),
           nb::arg("max_new_tokens"))
      .def("finish", &SchedulerCore::finish, nb::arg("handle"))
      .def("step", &SchedulerCore::step, nb::arg("num_steps") = 1,
           "Plan one iteration of num_steps decode steps (each request's window: fewer when its budget ends).")
      .def_prop_ro("num_steps", &SchedulerCore::num_steps)
      .def("max_context", &SchedulerCore::max_context)
      .def_prop_ro("iteration", &SchedulerCore::iteration)
      .def_prop_ro("last_admitted", &admitted)
      .def_prop_ro("last_finished", [](const SchedulerCore& c) { return int_list(c.last_finished()); })
      .def_prop_ro("last_preempted", [](const SchedulerCore& c) { return int_list(c.last_preempted()); })
      .def_prop_ro("last_rejected", [](const SchedulerCore& c) { return int_list(c.last_rejected()); })
      .def("batch_handles", &batch_handles, "Handles of the running requests in batch order (numpy int64).")
      .def("num_waiting", &SchedulerCore::num_waiting)
      .def("loads", &loads, "(kv_tokens, moe_batch, num_shards, free_pages) per instance.")
      .def("request_info", &request_info, nb::arg("handle"),
           "(prompt_len, max_new_tokens, decode_steps, status, moe_instance)")
      .def("binding", &binding, nb::arg("handle"), "(moe_instance, [(instance, n_tokens), ...]) in binding order.")
      .def("shard_pages", &shard_pages, nb::arg("handle"), "[(instance, n_tokens, [frames])] in binding order.")
      .def("lower_all", &lower_all, nb::arg("full") = false,
           "Per instance, the int32 routing table of the current iteration (incremental block tables, or full "
           "snapshots); the frames listed are marked as listed.")
      .def("lower_packed", &lower_packed, nb::arg("full") = false,
           "The tables of lower_all() back to back in one int32 array, with their int64 offsets [n + 1].")
      .def("lower", &lower_one, nb::arg("instance"), nb::arg("full") = false,
           "One instance's int32 routing table (only its frames are marked as listed).")
      .def("check_invariants", &SchedulerCore::check_invariants)
      .def_prop_ro("last_step_ns", &SchedulerCore::last_step_ns, "C++ wall time of the last step() (ns).")
      .def_prop_ro("last_lower_ns", &SchedulerCore::last_lower_ns,
                   "C++ wall time of the last lower_all()/lower() before the numpy wrapping (ns).");
}

}  // namespace nanocp
