"""How rank 0 names the hidden rows a call takes, without a process group."""

import torch

from mtp_runtime.multinode.leader import LockstepLeader, TrackedOutput
from mtp_runtime.multinode.step_plan import DRAFT, HIDDEN_FROM_DRAFT, HIDDEN_FROM_MAIN, HIDDEN_SENT, MAIN


def output(leader: LockstepLeader, target: int, rows: int) -> torch.Tensor:
    out = torch.randn(rows, 8).as_subclass(TrackedOutput)
    out._mtp_target = target
    leader.last_output[target] = out
    return out


def test_rows_of_the_latest_outputs_are_named_not_sent():
    leader = LockstepLeader()
    main = output(leader, MAIN, 6)
    draft = output(leader, DRAFT, 3)
    assert leader.hidden_source(main[torch.tensor([4, 1])]) == (HIDDEN_FROM_MAIN, [4, 1])
    assert leader.hidden_source(main[2:5]) == (HIDDEN_FROM_MAIN, [2, 3, 4])
    assert leader.hidden_source(main) == (HIDDEN_FROM_MAIN, list(range(6)))
    assert leader.hidden_source(draft[-1:]) == (HIDDEN_FROM_DRAFT, [2])
    assert type(main[torch.tensor([0])]) is torch.Tensor and type(main + 1) is torch.Tensor


def test_copies_the_workers_cannot_rebuild_are_sent():
    leader = LockstepLeader()
    main = output(leader, MAIN, 6)
    stale = main[torch.tensor([0, 1])]
    output(leader, MAIN, 6)  # a newer main forward: the workers no longer hold the old rows
    assert leader.hidden_source(stale)[0] == HIDDEN_SENT
    assert leader.hidden_source(main.index_select(0, torch.tensor([1])))[0] == HIDDEN_SENT
    assert leader.hidden_source(torch.randn(2, 8))[0] == HIDDEN_SENT
    assert leader.hidden_source(leader.last_output[MAIN][torch.tensor([-1])])[0] == HIDDEN_SENT
