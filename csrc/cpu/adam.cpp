// Placeholder until the adam op lands: registers nothing.
#include "ops.h"

namespace zero_engine {

void register_adam(pybind11::module_& m) { (void)m; }

}  // namespace zero_engine
