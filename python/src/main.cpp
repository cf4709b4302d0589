// The autosp._core extension: one NB_MODULE, one init_<area> per core area.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_ir(nb::module_& m);
void init_sp(nb::module_& m);
void init_remat(nb::module_& m);
void init_memory(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "autosp's C++ core: graph IR, placement analysis, SP plans, remat solver.";
  init_ir(m);
  init_sp(m);
  init_remat(m);
  init_memory(m);
}
