"""StepPlan: encoding, validation, and the broadcast from rank 0 over gloo."""

from __future__ import annotations

import random

import pytest
import torch

from mtp_runtime.multinode.step_plan import (
    ALLOCATE_CACHE,
    DRAFT,
    HIDDEN_FROM_DRAFT,
    HIDDEN_SENT,
    LOGITS,
    PLAN_CAPACITY,
    STOP,
    StepPlan,
)


def random_plan(rng: random.Random, target: int = 0, max_new: int = 3) -> StepPlan:
    """A verify/draft-shaped batch: B sequences with a few new tokens each."""
    block_size = 4
    input_ids, positions, qsl, ctx, tables, slots = [], [], [0], [], [], []
    for seq in range(rng.randint(1, 4)):
        new, cached = rng.randint(max(1, max_new // 2), max_new), rng.randint(0, 9)
        total = cached + new
        table = rng.sample(range(4096), -(-total // block_size))
        input_ids += [rng.randrange(50000) for _ in range(new)]
        positions += list(range(cached, total))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        qsl.append(qsl[-1] + new)
        ctx.append(total)
        tables.append(table)
    hidden_rows = list(range(len(input_ids))) if target == DRAFT else []
    return StepPlan(target=target, input_ids=input_ids, positions=positions,
                    query_start_loc=qsl, context_lens=ctx, block_tables=tables, slot_mapping=slots,
                    block_size=block_size, hidden_rows=hidden_rows,
                    hidden_source=HIDDEN_FROM_DRAFT if target == DRAFT else 0)


def test_round_trip_keeps_every_field():
    rng = random.Random(0)
    for target in (0, DRAFT, 0, DRAFT):
        plan = random_plan(rng, target)
        assert StepPlan.decode(plan.encode()) == plan
    others = (
        StepPlan(kind=STOP),
        StepPlan(kind=ALLOCATE_CACHE, num_blocks=128, block_size=16, dtype=torch.bfloat16),
        StepPlan(kind=LOGITS, target=DRAFT, hidden_source=HIDDEN_SENT, hidden_count=3, hidden_size=64),
        StepPlan(kind=LOGITS, hidden_rows=[4, 5]),
    )
    for plan in others:
        assert StepPlan.decode(plan.encode()) == plan
    draft = random_plan(rng, DRAFT)
    draft.select_rows = [draft.num_tokens - 1, 0]  # a draft pass whose output is these rows only
    assert StepPlan.decode(draft.encode()) == draft


def test_plan_gives_the_models_attention_metadata():
    plan = random_plan(random.Random(1))
    meta = plan.attention_metadata()
    assert meta.query_start_loc == plan.query_start_loc and meta.block_tables == plan.block_tables
    assert meta.slot_mapping.tolist() == plan.slot_mapping
    # The model derives each token's position from context_lens; the plan must agree.
    derived = torch.cat([pos for _, pos, _ in meta.sequences()]).tolist()
    assert derived == plan.positions


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(positions=[]), "StepPlan.positions: 0 entries"),
        (dict(query_start_loc=[0, 5]), "StepPlan.query_start_loc"),
        (dict(target=DRAFT), "StepPlan.hidden_rows"),
        (dict(target=DRAFT, hidden_source=HIDDEN_SENT, hidden_count=999, hidden_size=8), "StepPlan.hidden_count"),
        (dict(dtype=torch.int8), "StepPlan.dtype"),
        (dict(kind=9), "StepPlan.kind 9"),
        (dict(select_rows=[0]), "only a draft forward selects rows"),
        (dict(target=DRAFT, hidden_rows=[0] * 99, select_rows=[99]), r"StepPlan.select_rows \[99\]"),
    ],
)
def test_inconsistent_plans_are_rejected_by_field(change, needle):
    fields = random_plan(random.Random(2)).__dict__ | change
    with pytest.raises(ValueError, match=needle):
        StepPlan(**fields)


def test_damaged_payloads_are_rejected():
    payload = random_plan(random.Random(3)).encode()
    with pytest.raises(ValueError, match="truncated"):
        StepPlan.decode(payload[:-3])
    with pytest.raises(ValueError, match="trailing"):
        StepPlan.decode(torch.cat([payload, torch.tensor([7])]))
    with pytest.raises(ValueError, match="version"):
        StepPlan.decode(torch.tensor([42] * 12))


def test_broadcast_reaches_every_rank_unchanged(start_rank, free_port):
    ranks = [start_rank("plans", r, 2, free_port) for r in range(2)]
    codes = [r.wait(60) for r in ranks]
    outputs = [r.output for r in ranks]
    assert codes == [0, 0], "\n---\n".join(outputs)
    digests = [[line for line in out.splitlines() if line.startswith("PLAN ")] for out in outputs]
    assert len(digests[0]) == 21  # 20 forward plans (one too big for a single broadcast) and the STOP
    assert digests[0] == digests[1]
    assert max(int(line.split()[2]) for line in digests[0]) > PLAN_CAPACITY
