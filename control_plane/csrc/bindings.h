#pragma once
#include <nanobind/nanobind.h>

namespace nanocp {
namespace nb = nanobind;
void bind_scheduler(nb::module_& m);
void bind_cdsp(nb::module_& m);
}  // namespace nanocp
