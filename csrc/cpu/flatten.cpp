// Placeholder until the flatten op lands: registers nothing.
#include "ops.h"

namespace zero_engine {

void register_flatten(pybind11::module_& m) { (void)m; }

}  // namespace zero_engine
