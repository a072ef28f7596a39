// Placeholder until the overflow op lands: registers nothing.
#include "ops.h"

namespace zero_engine {

void register_overflow(pybind11::module_& m) { (void)m; }

}  // namespace zero_engine
