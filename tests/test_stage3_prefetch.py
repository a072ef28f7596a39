"""Stage 3's prefetch plan (engine/zero/stage3/prefetch.py) without processes: recording, following the
recorded order, detecting a changed order, the prefetch budget and live-parameter limit, the reuse
distance and a new micro-step. The collectives it drives are tested in test_stage3.py."""

from __future__ import annotations

from engine.zero.stage3.prefetch import PrefetchPlan, TraceMatch

BIG = 10**9

# A root unit (0) and three blocks (1-3); a micro-step's uses: forward root, blocks in order, then
# backward from the last block (the root stays gathered from forward to the end of backward).
NUMELS = [50, 100, 100, 100]
STEP = [0, 1, 2, 3, 3, 2, 1]


def make_plan(
    numels: list[int] = NUMELS, *, prefetch: int = BIG, max_live: int = BIG, reuse: int = BIG, persist_below: int = 0
) -> PrefetchPlan:
    return PrefetchPlan(
        numels, prefetch_numel=prefetch, max_live_numel=max_live, max_reuse_numel=reuse, persist_below=persist_below
    )


def recorded(plan: PrefetchPlan, uses: list[int] = STEP) -> PrefetchPlan:
    """`plan` after one micro-step that used `uses`."""
    for index in uses:
        plan.record(index, in_training=True)
    plan.end_micro_step()
    return plan


def test_first_micro_step_records_and_follows_nothing() -> None:
    plan = make_plan()
    assert [plan.record(i, in_training=True) for i in STEP] == [TraceMatch.UNTRACKED] * len(STEP)
    assert plan.trace is None and plan.recording == STEP
    assert plan.to_prefetch(live=set()) == []
    assert not plan.reused_soon(1, live={1})
    plan.end_micro_step()
    assert plan.trace == STEP
    assert plan.recording == [] and plan.pos == 0 and plan.following
    assert plan.order_changes == 0


def test_same_order_is_followed_use_by_use() -> None:
    plan = recorded(make_plan())
    for n, index in enumerate(STEP, start=1):
        assert plan.record(index, in_training=True) is TraceMatch.FOLLOWED
        assert plan.pos == n
    plan.end_micro_step()
    assert plan.trace == STEP and plan.order_changes == 0


def test_prefetch_takes_the_next_units_in_recorded_order() -> None:
    plan = recorded(make_plan())
    plan.record(0, in_training=True)
    # Everything fits: each unit once (3 is used twice in a row, 2 and 1 again in backward).
    assert plan.to_prefetch(live={0}) == [1, 2, 3]
    # Units already gathered or gathering are skipped and not started again.
    assert plan.to_prefetch(live={0, 1, 3}) == [2]


def test_prefetch_bucket_size_bounds_the_elements_started_at_once() -> None:
    # DeepSpeed's rule: units are taken while those taken are under the bucket; the one that crosses it
    # is taken too, then nothing after it.
    plan = recorded(make_plan(prefetch=200))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1, 2]  # 100 < 200 takes 2; 200 is not under 200
    plan = recorded(make_plan(prefetch=250))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1, 2, 3]  # 200 < 250: 3 crosses the bucket and is started
    plan = recorded(make_plan(prefetch=99))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1]  # a unit larger than the whole bucket still goes alone
    plan = recorded(make_plan(prefetch=0))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == []  # 0 turns prefetching off


def test_the_unit_that_crosses_the_budget_ends_the_prefetch() -> None:
    # Unit 2 crosses what is left of the budget and is the last one taken; unit 3 would fit in the
    # bucket's size alone, but it comes after the crossing.
    plan = recorded(make_plan([10, 100, 500, 50], prefetch=300), [0, 1, 2, 3])
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1, 2]


def test_max_live_parameters_counts_gathered_units_too() -> None:
    plan = recorded(make_plan(max_live=250))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1, 2]  # limit 250 - 50 = 200: 1, then 2 reaches it
    assert plan.to_prefetch(live={0, 1}) == [2]  # the live 1 counts: limit 250 - 150 = 100
    assert plan.live_numel({0, 1}) == 150
    plan = recorded(make_plan(max_live=149))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == [1]  # limit 99: the next unit crosses it, and goes (live 150)
    plan = recorded(make_plan(max_live=50))
    plan.record(0, in_training=True)
    assert plan.to_prefetch(live={0}) == []  # the live units already fill it


def test_prefetch_looks_ahead_from_the_current_position() -> None:
    plan = recorded(make_plan(prefetch=100))
    for index in [0, 1, 2, 3]:  # forward done
        assert plan.record(index, in_training=True) is TraceMatch.FOLLOWED
    # Next in the trace: 3 (live), then 2 and 1 for backward; the budget takes one.
    assert plan.to_prefetch(live={0, 3}) == [2]
    plan.record(3, in_training=True)
    plan.record(2, in_training=True)
    assert plan.to_prefetch(live={0, 2}) == [1]


def test_a_changed_order_is_counted_once_then_gathered_on_demand_and_adopted() -> None:
    plan = recorded(make_plan())
    changed = [0, 1, 3, 3, 1]  # block 2 skipped this micro-step
    outcomes = [plan.record(i, in_training=True) for i in changed]
    assert outcomes == [
        TraceMatch.FOLLOWED,
        TraceMatch.FOLLOWED,
        TraceMatch.DIVERGED,
        TraceMatch.UNTRACKED,
        TraceMatch.UNTRACKED,
    ]
    assert plan.order_changes == 1 and not plan.following
    assert not plan.reused_soon(3, live={0, 3})  # nothing is kept for reuse off the recorded order
    plan.end_micro_step()
    assert plan.trace == changed and plan.following and plan.pos == 0
    # The new order is followed from the next micro-step on.
    assert [plan.record(i, in_training=True) for i in changed] == [TraceMatch.FOLLOWED] * len(changed)
    plan.end_micro_step()
    assert plan.order_changes == 1


def test_a_trace_longer_than_the_recorded_one_diverges() -> None:
    plan = recorded(make_plan(), [0, 1])
    assert plan.record(0, in_training=True) is TraceMatch.FOLLOWED
    assert plan.record(1, in_training=True) is TraceMatch.FOLLOWED
    assert plan.record(2, in_training=True) is TraceMatch.DIVERGED
    assert plan.order_changes == 1


def test_uses_outside_training_are_recorded_but_not_followed() -> None:
    plan = recorded(make_plan())
    assert plan.record(0, in_training=False) is TraceMatch.UNTRACKED
    assert plan.pos == 0 and plan.following and plan.order_changes == 0
    assert plan.recording == [0]


def test_reuse_within_the_distance_keeps_a_unit_after_its_forward() -> None:
    plan = recorded(make_plan(reuse=0))
    for index in [0, 1, 2, 3]:
        plan.record(index, in_training=True)
    # The last block's backward comes next: reused at distance 0, kept even with reuse 0.
    assert plan.reused_soon(3, live={0, 3})
    assert plan.keep_after_forward(3, live={0, 3})
    plan = recorded(make_plan(reuse=0))
    for index in [0, 1]:
        plan.record(index, in_training=True)
    # Block 1 is used again after 2 and 3 (200 elements): re-gathered with reuse 0 ...
    assert not plan.reused_soon(1, live={0, 1})
    plan = recorded(make_plan(reuse=199))
    for index in [0, 1]:
        plan.record(index, in_training=True)
    assert not plan.reused_soon(1, live={0, 1})
    # ... kept when the units in between fit the distance exactly (distinct units count once).
    plan = recorded(make_plan(reuse=200))
    for index in [0, 1]:
        plan.record(index, in_training=True)
    assert plan.reused_soon(1, live={0, 1})


def test_a_unit_not_used_again_is_not_kept() -> None:
    plan = recorded(make_plan(), [0, 1, 2, 3])  # no backward recorded: nothing is reused
    for index in [0, 1]:
        plan.record(index, in_training=True)
    assert not plan.reused_soon(1, live={0, 1})


def test_keeping_for_reuse_respects_max_live_parameters() -> None:
    plan = recorded(make_plan(max_live=249))
    for index in [0, 1, 2, 3]:
        plan.record(index, in_training=True)
    assert plan.reused_soon(3, live={0, 3})  # 150 <= 249
    assert not plan.reused_soon(3, live={0, 1, 2, 3})  # 350 > 249


def test_units_under_the_persistence_threshold_are_always_kept() -> None:
    plan = make_plan(persist_below=100, reuse=0)  # no trace: nothing is reused
    assert plan.persistent(0) and not plan.persistent(1)
    assert plan.keep_after_forward(0, live={0})
    assert not plan.keep_after_forward(1, live={1})


def test_a_new_micro_step_restarts_the_recorded_order() -> None:
    plan = recorded(make_plan())
    for index in [0, 1]:
        plan.record(index, in_training=True)
    plan.new_micro_step()  # a forward without backward (or a second one) before the backward
    assert plan.trace == STEP and plan.recording == [] and plan.pos == 0
    assert plan.record(0, in_training=True) is TraceMatch.FOLLOWED
    # After a divergence too: the next micro-step follows again, from the start.
    plan.record(3, in_training=True)
    assert not plan.following and plan.order_changes == 1
    plan.new_micro_step()
    assert plan.following and plan.trace == STEP
    assert plan.record(0, in_training=True) is TraceMatch.FOLLOWED


def test_a_micro_step_without_uses_keeps_the_trace_and_forget_drops_it() -> None:
    plan = recorded(make_plan())
    assert not plan.recording_started
    plan.end_micro_step()
    assert plan.trace == STEP
    plan.record(0, in_training=True)
    assert plan.recording_started
    plan.forget()
    assert plan.trace is None
    assert plan.record(1, in_training=True) is TraceMatch.UNTRACKED
    assert plan.to_prefetch(live=set()) == []
