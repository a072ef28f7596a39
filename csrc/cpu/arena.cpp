// Placeholder until the arena op lands: registers nothing.
#include "ops.h"

namespace zero_engine {

void register_arena(pybind11::module_& m) { (void)m; }

}  // namespace zero_engine
