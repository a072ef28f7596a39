"""`deepspeed.runtime.zero.partition_parameters` IS engine.zero.partitioned_init (the same module object,
not a copy of its names): transformers' `prevent_arange_dtype_change` replaces this module's
`zero_wrapper_for_fp_tensor_constructor` around every stage-3 from_config/from_pretrained, and Init
must see that replacement (it also reads `_orig_torch_arange` and `get_accelerator` here)."""

import sys

from engine.zero import partitioned_init as _init

sys.modules[__name__] = _init
