"""Every shipped config in configs/ loads at world sizes 1, 2 and 4."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.json"))


def test_configs_directory_is_not_empty() -> None:
    # Guards against the parametrised test below passing vacuously.
    assert CONFIGS, f"no *.json files in {CONFIG_DIR}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path: Path, world_size: int) -> None:
    cfg = load_config(path, world_size=world_size, world_size_source="test parameter")
    assert cfg.world_size == world_size
    assert cfg.train_batch_size == (
        cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world_size
    )
