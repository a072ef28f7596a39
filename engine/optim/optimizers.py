"""`optimizer` config section -> a torch.optim.Optimizer, with DeepSpeed's names and semantics.

Names are case-insensitive. DeepSpeed's own names (Adam, AdamW, Lamb, Lion) take DeepSpeed's
parameter names and defaults; any other `torch.optim` class name is built with the params passed
through, checked against that class's signature. Values in the caller's param groups override
the config params per group, as torch does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from engine.config.errors import ConfigError
from engine.config.types import OptimizerConfig
from engine.optim._check import check_bool, check_number, check_param_names, did_you_mean, keyword_params
from engine.optim.adam import ADAM_DEFAULTS, ReferenceAdam
from engine.optim.lamb import Lamb
from engine.optim.lion import Lion

logger = logging.getLogger(__name__)

_SECTION = "optimizer.params"

# DeepSpeed's FusedAdam parameters and defaults (ADAM_DEFAULTS says why weight_decay is 0).
_ADAM_DEFAULTS: Mapping[str, Any] = {
    **ADAM_DEFAULTS,
    "bias_correction": True,
    "adam_w_mode": True,
    "amsgrad": False,
    "torch_adam": False,  # DeepSpeed's switch to torch's Adam; we always use torch's, so a no-op.
    "set_grad_none": True,  # FusedAdam's zero_grad detail; the engine decides how grads are zeroed.
}
# torch's implementation switches, accepted for Adam because DeepSpeed forwards them with torch_adam.
_ADAM_TORCH_SWITCHES = ("foreach", "fused")

# DeepSpeed's FusedLamb parameters and defaults.
_LAMB_DEFAULTS: Mapping[str, Any] = {
    **ADAM_DEFAULTS,
    "bias_correction": True,
    "eps_inside_sqrt": False,
    "max_coeff": 10.0,
    "min_coeff": 0.01,
    "amsgrad": False,
}

_LION_DEFAULTS: Mapping[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}

# These compress gradients in DeepSpeed's own communication backend, which we do not have.
_UNSUPPORTED = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}

_DEEPSPEED_NAMES = ("Adam", "AdamW", "Lamb", "Lion")


def build_optimizer(cfg: OptimizerConfig, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Build the optimizer named by `cfg.type` over `param_groups` (torch's list-of-dicts form)."""
    params = dict(cfg.params)
    _check_no_max_grad_norm(params)
    key = cfg.type.lower()
    if key in _UNSUPPORTED:
        raise ConfigError(
            f'optimizer.type "{cfg.type}": {_UNSUPPORTED[key]} is not supported: it needs DeepSpeed\'s '
            "compressed communication backend. Use Adam/AdamW (or Lamb) instead."
        )
    if key in ("adam", "adamw"):
        return _build_adam(key == "adamw", params, param_groups)
    if key == "lamb":
        return _build_lamb(params, param_groups)
    if key == "lion":
        return _build_with_defaults(Lion, "Lion", _LION_DEFAULTS, params, param_groups)
    torch_cls = _torch_optimizer_classes().get(key)
    if torch_cls is not None:
        return _build_torch(torch_cls, params, param_groups)
    torch_names = sorted(c.__name__ for k, c in _torch_optimizer_classes().items() if k not in ("adam", "adamw"))
    known = [*_DEEPSPEED_NAMES, *torch_names]
    raise ConfigError(
        f'optimizer.type "{cfg.type}" is not a known optimizer.{did_you_mean(cfg.type, known)} '
        f"Known (case-insensitive): {', '.join(known)}."
    )


def _check_no_max_grad_norm(params: Mapping[str, Any]) -> None:
    # DeepSpeed refuses it too: clipping is an engine concern (global norm across ranks).
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm is not supported; use the top-level "
            '"gradient_clipping": <max norm> instead.'
        )


def _build_adam(is_adamw: bool, params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    name = "AdamW" if is_adamw else "Adam"
    check_param_names(_SECTION, name, params, [*_ADAM_DEFAULTS, *_ADAM_TORCH_SWITCHES])
    merged = {**_ADAM_DEFAULTS, **params}
    _check_common(merged)
    if check_bool(f"{_SECTION}.amsgrad", merged.pop("amsgrad")):
        raise ConfigError(
            f"{_SECTION}.amsgrad=true is not supported: DeepSpeed's FusedAdam has no AMSGrad variant, "
            "so a config that trains in DeepSpeed never uses it. Remove amsgrad or set it to false."
        )
    adam_w_mode = check_bool(f"{_SECTION}.adam_w_mode", merged.pop("adam_w_mode"))
    if is_adamw and not adam_w_mode:
        # DeepSpeed: "Optimizer name of Adam forces AdamW logic unless adam_w_mode is explicitly set";
        # for the name AdamW the flag is ignored. Keep that, but say so.
        logger.warning('optimizer "AdamW" ignores adam_w_mode=false (as DeepSpeed does); use "Adam" for L2 decay.')
        adam_w_mode = True
    bias_correction = check_bool(f"{_SECTION}.bias_correction", merged.pop("bias_correction"))
    check_bool(f"{_SECTION}.torch_adam", merged.pop("torch_adam"))
    merged.pop("set_grad_none")

    if not bias_correction:
        # torch's Adam always bias-corrects; the reference class implements FusedAdam's switch.
        for switch in _ADAM_TORCH_SWITCHES:
            merged.pop(switch, None)
        return _construct(ReferenceAdam, groups, adam_w_mode=adam_w_mode, bias_correction=False, **merged)

    # foreach is bit-identical to the per-tensor loop on CPU and faster; fused is not identical
    # (last-ulp differences), so it is used only when asked for.
    if "fused" not in merged:
        merged.setdefault("foreach", True)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return _construct(cls, groups, **merged)


def _build_lamb(params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    check_param_names(_SECTION, "Lamb", params, _LAMB_DEFAULTS)
    merged = {**_LAMB_DEFAULTS, **params}
    _check_common(merged)
    if check_bool(f"{_SECTION}.amsgrad", merged.pop("amsgrad")):
        raise ConfigError(f"{_SECTION}.amsgrad=true is not supported by Lamb (nor by DeepSpeed's FusedLamb).")
    for key in ("max_coeff", "min_coeff"):
        check_number(f"{_SECTION}.{key}", merged[key], minimum=0.0)
    if merged["min_coeff"] > merged["max_coeff"]:
        raise ConfigError(
            f"{_SECTION}: min_coeff({merged['min_coeff']}) > max_coeff({merged['max_coeff']}); "
            "the trust ratio is clamped to [min_coeff, max_coeff]."
        )
    return _construct(Lamb, groups, **merged)


def _build_with_defaults(
    cls: type[torch.optim.Optimizer],
    name: str,
    defaults: Mapping[str, Any],
    params: dict[str, Any],
    groups: list[dict[str, Any]],
) -> torch.optim.Optimizer:
    check_param_names(_SECTION, name, params, defaults)
    merged = {**defaults, **params}
    _check_common(merged)
    return _construct(cls, groups, **merged)


def _build_torch(
    cls: type[torch.optim.Optimizer], params: dict[str, Any], groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    accepted, _required, var_kwargs = keyword_params(cls.__init__, skip=2)  # skip self, params
    if not var_kwargs:
        check_param_names(_SECTION, f"torch.optim.{cls.__name__}", params, accepted)
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])  # JSON has no tuples; some torch checks want one
    return _construct(cls, groups, **params)


def _check_common(merged: dict[str, Any]) -> None:
    """Type-check the DeepSpeed params shared by Adam, Lamb and Lion; normalise betas to a tuple."""
    for key in ("lr", "eps", "weight_decay"):
        if key in merged:
            check_number(f"{_SECTION}.{key}", merged[key], minimum=0.0)
    if "betas" in merged:
        betas = merged["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"{_SECTION}.betas must be a list of two numbers in [0, 1), got {betas!r}.")
        for b in betas:
            if check_number(f"{_SECTION}.betas", b) >= 1.0 or b < 0.0:
                raise ConfigError(f"{_SECTION}.betas must be a list of two numbers in [0, 1), got {betas!r}.")
        merged["betas"] = (float(betas[0]), float(betas[1]))


def _construct(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    # torch validates values (negative lr, bad momentum, nesterov without momentum...) with
    # ValueError/TypeError; surface those as config errors naming the section.
    try:
        return cls(groups, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{_SECTION} rejected by {cls.__module__}.{cls.__name__}: {exc}") from exc


def _torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Lower-cased name -> every public torch.optim optimizer class."""
    classes: dict[str, type[torch.optim.Optimizer]] = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
            and not attr.startswith("_")
        ):
            classes[attr.lower()] = obj
    return classes
