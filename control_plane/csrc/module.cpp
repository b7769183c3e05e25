// nanocp._core: the C++ control-plane core. Each part of the core lives in its own .cpp and registers its
// bindings through a bind_<part>() hook declared in bindings.h.
#include "bindings.h"

NB_MODULE(_core, m) {
  m.doc() = "nanocp C++ control-plane core (page table, DCP placement, lowering, CDSP planner)";
  nanocp::bind_scheduler(m);
  nanocp::bind_cdsp(m);
}
