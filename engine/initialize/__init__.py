"""`engine.initialize(...)`, DeepSpeed's entry point, and what only it uses.

- entry.py: initialize() (config -> process group -> groups -> model checks -> stage -> Engine) and
  add_config_arguments();
- parallel_setup.py: which tensor x data-parallel groups the engine trains over, from mpu=, the config
  or groups made earlier (AutoTP applied when the config asks for it);
- rank_agreement.py: every rank agrees it built the same model and config before the first
  collective, or all fail with the first difference named;
- param_groups.py: model_parameters / optimizer param groups normalised and checked;
- data.py: the DistributedSampler loader built from training_data.
"""

from engine.initialize.entry import add_config_arguments, initialize

__all__ = ["add_config_arguments", "initialize"]
