#include "bindings.h"

namespace nanocp {
void bind_scheduler(nb::module_& m) { m.attr("CORE_VERSION") = 1; }
}  // namespace nanocp
