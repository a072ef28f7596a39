"""Batch-size rules (DeepSpeed's): train = micro x gas x world size, any two infer the third."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ConfigError, load_config
from engine.config.batch import BatchSizes, resolve_batch_sizes

SRC = "WORLD_SIZE env (torchrun)"


def sizes(world_size: int, **cfg: Any) -> tuple[int, int, int]:
    c = load_config(cfg, world_size=world_size, world_size_source=SRC)
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps


def problem(world_size: int, **cfg: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, world_size=world_size, world_size_source=SRC)
    (message,) = info.value.problems
    return message


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_three_consistent(world_size: int) -> None:
    train = 4 * 3 * world_size
    assert sizes(
        world_size, train_batch_size=train, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3
    ) == (train, 4, 3)


def test_train_and_micro_infer_gas() -> None:
    assert sizes(2, train_batch_size=32, train_micro_batch_size_per_gpu=4) == (32, 4, 4)


def test_train_and_gas_infer_micro() -> None:
    assert sizes(2, train_batch_size=32, gradient_accumulation_steps=4) == (32, 4, 4)


def test_micro_and_gas_infer_train() -> None:
    assert sizes(4, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2) == (24, 3, 2)


def test_train_only_gives_gas_1() -> None:
    assert sizes(4, train_batch_size=32) == (32, 8, 1)


def test_micro_only_gives_gas_1() -> None:
    assert sizes(4, train_micro_batch_size_per_gpu=5) == (20, 5, 1)


def test_float_spelling_of_integers_is_accepted() -> None:
    assert sizes(1, train_batch_size=8.0, train_micro_batch_size_per_gpu=2) == (8, 2, 4)
    assert isinstance(sizes(1, train_batch_size=8.0)[0], int)


def test_inconsistent_triple_shows_arithmetic_and_world_size_source() -> None:
    message = problem(2, train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    assert message.startswith(
        "train_batch_size (32) != train_micro_batch_size_per_gpu (4) x "
        "gradient_accumulation_steps (2) x world size (2) = 16; "
        "world size 2 detected from WORLD_SIZE env (torchrun); fix: "
    )
    assert "set train_batch_size to 16" in message


def test_train_not_divisible_by_micro_times_world() -> None:
    message = problem(2, train_batch_size=30, train_micro_batch_size_per_gpu=4)
    assert (
        "train_batch_size (30) is not a positive multiple of train_micro_batch_size_per_gpu (4) x "
        "world size (2) = 8" in message
    )
    assert "gradient_accumulation_steps cannot be inferred" in message
    assert "world size 2 detected from WORLD_SIZE env (torchrun)" in message
    assert "e.g. 24 or 32" in message


def test_train_smaller_than_micro_times_world() -> None:
    message = problem(4, train_batch_size=4, train_micro_batch_size_per_gpu=2)
    assert (
        "train_batch_size (4) is not a positive multiple of train_micro_batch_size_per_gpu (2) x "
        "world size (4) = 8" in message
    )


def test_train_not_divisible_by_gas_times_world() -> None:
    message = problem(2, train_batch_size=10, gradient_accumulation_steps=3)
    assert "gradient_accumulation_steps (3) x world size (2) = 6" in message
    assert "train_micro_batch_size_per_gpu cannot be inferred" in message


def test_train_only_not_divisible_by_world() -> None:
    message = problem(4, train_batch_size=6)
    assert "train_batch_size (6) is not a positive multiple of world size (4) = 4" in message
    assert "gradient_accumulation_steps defaults to 1" in message


def test_neither_train_nor_micro() -> None:
    assert problem(1).startswith("neither train_batch_size nor train_micro_batch_size_per_gpu is set; fix:")
    assert "gradient_accumulation_steps alone is not enough" in problem(1, gradient_accumulation_steps=2)


def test_world_size_source_is_quoted_verbatim() -> None:
    with pytest.raises(ConfigError, match="detected from the --world-size flag"):
        load_config(
            {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
            world_size=2,
            world_size_source="the --world-size flag",
        )


def test_pure_function_reports_inference_notes() -> None:
    result, problems, notes = resolve_batch_sizes(32, 4, None, world_size=2, world_size_source=SRC)
    assert result == BatchSizes(32, 4, 4) and problems == []
    assert notes == ["gradient_accumulation_steps inferred as 4 = 32 / (4 x 2)"]
