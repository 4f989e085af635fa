"""DiLoCo checkpoints across an elastic layout change (trainer/checkpoint/state.py, trainer/parallel/
diloco.py): a replica the checkpoint holds resumes its own parameters and inner optimizer; one it
does not hold (a rejoining replica: dp_replicate grew) starts from the anchors, with replica 0's
inner optimizer state; a run resumed without DiLoCo (one replica left) takes the anchors as its
model. First in one process (a gloo group of one) on a small model: the checkpoint is written as
replicas 0 and 1 of a dp 2 run would write it, then read as replicas 1 and 2 and as a plain run; then
through the real trainer (torchrun, dp 2 -> dp 3 and dp 2 -> 1). Before the change a rejoining replica
ended with "Missing key in checkpoint state_dict: app.replica2.model...". """

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer.checkpoint import safe_read
from trainer.checkpoint.state import ModelOptimState, saved_replicas
from trainer.config.schema import DiLoCoConfig
from trainer.parallel.diloco import DiLoCo, Fragment
from trainer.parallel.sync_meter import SyncMeter


@pytest.fixture(scope="module", autouse=True)
def _one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _replica(k: int | None, seed: int):
    """(model, AdamW with one step's state, DiLoCo as replica k or None): parameters from `seed`."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    if k is None:
        return model, opt, None
    cfg = DiLoCoConfig(inner_steps=4, outer_momentum=0.9)
    params = list(model.parameters())
    dl = DiLoCo([Fragment(params, [list(range(len(params)))])], dist.group.WORLD, cfg, SyncMeter(), k)
    return model, opt, dl


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _exp_avg(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["exp_avg"].clone() for g in opt.param_groups for p in g["params"]]


def test_a_rejoining_replica_starts_from_the_anchor_and_the_others_from_their_own(tmp_path):
    # The dp 2 run's checkpoint: anchors (shared), outer momentum, each replica's own params + AdamW.
    m0, o0, d0 = _replica(0, seed=0)
    m1, o1, d1 = _replica(1, seed=1)
    anchors = [torch.full_like(a, 0.25 + i) for i, a in enumerate(d0.fragments[0].anchor)]
    for d in (d0, d1):
        for a, v in zip(d.fragments[0].anchor, anchors, strict=True):
            a.copy_(v)
    with torch.no_grad():  # the replicas moved away from the anchors since the last sync
        for p in m1.parameters():
            p.add_(1.5)
    own1, adam0, adam1 = _params(m1), _exp_avg(o0), _exp_avg(o1)
    state = ModelOptimState(m0, o0, d0).state_dict()
    state["replica1"] = ModelOptimState(m1, o1, d1).state_dict()["replica1"]
    path = tmp_path / "step-8"
    dcp.save({"app": state}, checkpoint_id=str(path))
    keys = safe_read.read_metadata(path / ".metadata").state_dict_metadata
    assert saved_replicas(keys) == {0, 1}
    assert saved_replicas(["app.model.0.weight", "app.optim.state.0.weight.exp_avg"]) is None

    def resume(k: int | None) -> tuple[nn.Module, torch.optim.Optimizer, DiLoCo | None]:
        model, opt, dl = _replica(k, seed=7)  # another run's values: all of them must be overwritten
        app = ModelOptimState(model, opt, dl)
        app.saved_replicas = saved_replicas(keys)
        safe_read.load({"app": app}, path)
        return model, opt, dl

    # replica 1 is in the checkpoint: its own parameters and AdamW, the shared anchors
    m, o, d = resume(1)
    assert all(torch.equal(a, b) for a, b in zip(_params(m), own1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_exp_avg(o), adam1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(d.fragments[0].anchor, anchors, strict=True))
    # replica 2 rejoins: it starts from the anchors, with replica 0's inner optimizer state
    m, o, d = resume(2)
    assert all(torch.equal(a, b) for a, b in zip(_params(m), anchors, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(d.fragments[0].anchor, anchors, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_exp_avg(o), adam0, strict=True))
    assert not torch.equal(_params(m)[0], own1[0])
    # one replica left (DiLoCo off): the anchors are its model
    m, o, d = resume(None)
    assert d is None and all(torch.equal(a, b) for a, b in zip(_params(m), anchors, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_exp_avg(o), adam0, strict=True))
    # ... and what it saves next is a plain checkpoint again (the checkpointer resets saved_replicas)
    app = ModelOptimState(m, o, None)
    assert set(app.state_dict()) == {"model", "optim"}


@pytest.mark.multiproc
def test_an_elastic_width_change_resumes_through_the_checkpointer(tmp_path):
    """The real trainer: a dp 2 DiLoCo run stopped at step 6 (between two outer steps) resumes as dp 3
    (replica 2 rejoins: not in the checkpoint) and as one process (DiLoCo off). dp 3 syncs its three
    replicas at steps 8 and 12: after the outer step at 12 every replica holds the anchors; the one
    process's final model is a plain checkpoint again."""
    import shutil

    from tests.support.trainer_run import checkpoint_tensors, run_trainer

    job = ("--config", "configs/tiny.yaml", "--train.grad_clip", "0", "--checkpoint.enabled", "true",
           "--parallel.dp_sync", "diloco", "--parallel.diloco.inner_steps", "4", "--train.steps", "12")
    wide, one = tmp_path / "wide", tmp_path / "one"
    run_trainer(wide, *job, "--train.exit_interval", "6", nproc=2)
    assert (wide / "checkpoints" / "latest").read_text().strip() == "step-6"
    shutil.copytree(wide, one)
    run_trainer(wide, *job, "--resume", "latest", nproc=3)
    t = checkpoint_tensors(wide / "checkpoints" / "step-12")
    anchors = {k[len("app.model."):]: v for k, v in t.items() if k.startswith("app.model.")}
    for r in range(3):
        own = {k[len(f"app.replica{r}.model."):]: v for k, v in t.items() if k.startswith(f"app.replica{r}.model.")}
        assert own.keys() == anchors.keys() and len(own) > 5, r
        assert all(torch.equal(own[k], anchors[k]) for k in own), r
    run_trainer(one, *job, "--resume", "latest", nproc=1)
    t = checkpoint_tensors(one / "checkpoints" / "step-12")
    assert not any(k.startswith(("app.replica", "app.diloco")) for k in t) and any(k.startswith("app.optim.") for k in t)
