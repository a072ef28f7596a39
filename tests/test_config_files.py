"""Every shipped config in configs/ loads at world sizes 1, 2 and 4."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, load_config
from engine.config.source import read_source

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))
HF_CONFIGS = sorted((CONFIG_DIR / "hf").glob("*.json"))


def test_configs_directory_is_not_empty() -> None:
    # Guards against the parametrised tests below passing vacuously.
    assert CONFIGS, f"no *.json files in {CONFIG_DIR}"
    assert HF_CONFIGS, f"no *.json files in {CONFIG_DIR / 'hf'}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path, world_size: int) -> None:
    """Batch sizes count data-parallel ranks: the world over tensor_parallel.autotp_size (which must
    divide it, or the load is refused naming both sizes)."""
    tp = max(1, read_source(path)[0].get("tensor_parallel", {}).get("autotp_size", 1))
    if world_size % tp:
        with pytest.raises(
            ConfigError, match=f"tensor-parallel size {tp} .* does not divide the world size {world_size}"
        ):
            load_config(path, world_size=world_size, world_size_source="test parameter")
        return
    cfg = load_config(path, world_size=world_size, world_size_source="test parameter")
    assert cfg.world_size == world_size // tp
    assert cfg.autotp_size == tp
    assert cfg.train_batch_size == (
        cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world_size // tp
    )


@pytest.mark.parametrize("path", HF_CONFIGS, ids=[p.name for p in HF_CONFIGS])
def test_hf_configs_are_plain_json_whose_autos_only_trainer_fills(path: Path) -> None:
    """configs/hf/ holds configs in the form of HF's DeepSpeed docs (tests/test_hf_trainer.py trains with
    them): strict JSON (HF reads them with json.load) whose "auto" values only the Trainer can fill, so
    given to initialize directly each "auto" is named."""
    import json

    raw = json.loads(path.read_text())
    assert raw["train_micro_batch_size_per_gpu"] == "auto"
    with pytest.raises(ConfigError) as err:
        load_config(path, world_size=2, world_size_source="test parameter")
    assert 'train_micro_batch_size_per_gpu: "auto" can only be filled in by the Hugging Face Trainer' in str(err.value)
