"""Sync's overlap=True (raftps/torch/overlap.py) against a real cluster of 3 nodes and 2 Raft
groups, K ranks in threads: the same bits as without overlap (chunks sent during backward, in
the order backward makes the gradients), no_sync() accumulation, and the refusals."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import jobs  # noqa: E402
from raftps.torch.overlap import OverlapError  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402

BASE_PORT = 24100
STEPS = 12
CHUNK = 256          # bytes: most of the model's tensors a chunk of their own, some two to a chunk


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("overlap") / "run", BASE_PORT, groups=2)
    yield cl
    cl.wipe()


class Net(torch.nn.Module):
    """Linear layers, a BatchNorm (buffers: their drift goes at step()), and a parameter no
    forward uses (no gradient: its chunk goes at step(), as zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(10, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.norm(self.inp(x))))))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batches(steps: int, batch: int = 24, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 10, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def train(cluster, prefix: str, world: int, data, micro: int = 1, **options) -> tuple[list[Net], list[int]]:
    """``world`` sync ranks in threads, torch's Adam with a StepLR (the lr changes every 4 steps,
    after opt.step()), each rank on its 1/world of every batch in ``micro`` micro-batches
    (all but the last inside no_sync()). Their models, and per rank the chunks that had left
    before opt.step() at each step."""
    models = [net() for _ in range(world)]
    early: list[list[int]] = [[] for _ in range(world)]
    starts = [-1] * world

    def rank_body(rank: int) -> None:
        model = models[rank]
        base = torch.optim.Adam(model.parameters(), lr=0.01)
        with cluster.client() as client, \
                rpt.DistributedOptimizer(base, cluster=client, model=model, mode="sync", prefix=prefix,
                                         rank=rank, world_size=world, chunk_bytes=CHUNK, **options) as opt:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            for x, y in data:
                part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
                xs, ys = x[part].chunk(micro), y[part].chunk(micro)
                opt.zero_grad()
                for i, (xm, ym) in enumerate(zip(xs, ys)):
                    if i < micro - 1:
                        with opt.no_sync():
                            (loss_of(model, xm, ym) / micro).backward()
                    else:
                        (loss_of(model, xm, ym) / micro).backward()
                if not early[rank]:
                    starts[rank] = opt.start_step
                overlap = opt._raftps.overlap
                early[rank].append(len(overlap._sent) if overlap is not None else 0)
                opt.step()
                sched.step()
    run_ranks(world, rank_body, timeout=180)
    train.starts = starts
    return models, early


def assert_same_bits(a: Net, b: Net) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), f"{name} differs: max {(p.double() - q.double()).abs().max().item()}"


def test_overlap_gives_the_bits_of_steps_sent_after_backward(cluster):
    """K=3, chunks of 256 bytes over 2 Raft groups: overlap on and off end with the same
    parameters and BatchNorm statistics, bit for bit, and with overlap the parameters' chunks
    (all but the unused parameter's, and those after it in its group) left during backward from
    the second step on (the first step checks, and sends at step())."""
    data = batches(STEPS)
    plain, _ = train(cluster, "ov-plain", 3, data)
    streamed, early = train(cluster, "ov-streamed", 3, data, overlap=True)
    for model in streamed:
        assert_same_bits(plain[0], model)
    assert not torch.equal(plain[0].out.weight, net().out.weight)          # it trained
    for per_step in early:
        assert per_step[0] == 0, "the first step sends nothing before opt.step()"
        assert min(per_step[1:]) >= 3, f"chunks sent during backward per step: {per_step}"


def test_overlap_in_pairs_gives_the_bits_of_pairs_without_overlap(cluster):
    """K=4 in two pairs: each rank's half of the chunks summed with its partner's as backward
    makes them; the same bits as pairs without overlap ((g0 + g1) + (g2 + g3))."""
    data = batches(6, seed=7)
    plain, _ = train(cluster, "pairs-plain", 4, data, pairs=True)
    streamed, early = train(cluster, "pairs-streamed", 4, data, pairs=True, overlap=True)
    for model in streamed:
        assert_same_bits(plain[0], model)
    assert min(n for per_step in early for n in per_step[1:]) >= 3


def test_no_sync_accumulation_gives_the_bits_of_accumulating_without_overlap(cluster):
    data = batches(8, batch=24, seed=3)
    plain, _ = train(cluster, "acc-plain", 2, data, micro=3)
    streamed, early = train(cluster, "acc-streamed", 2, data, micro=3, overlap=True)
    for model in streamed:
        assert_same_bits(plain[0], model)
    assert min(early[0][1:]) >= 3


def test_a_job_resumes_with_overlap_where_its_chunks_applied(cluster):
    """4 steps, every rank's objects made again, 4 more: the second run starts at step 4 (every
    chunk's applied step read), and ends with the bits of the same two runs without overlap."""
    data = batches(8, seed=5)
    for prefix, options in (("resume-plain", {}), ("resume-streamed", {"overlap": True})):
        train(cluster, prefix, 2, data[:4], **options)
        assert train.starts == [0, 0]
        models, _ = train(cluster, prefix, 2, data[4:], **options)
        assert train.starts == [4, 4]
        if options:
            assert_same_bits(plain, models[1])
        plain = models[0]


def one_rank(cluster, prefix: str, **options):
    """One rank's model and optimizer; the optimizer's close() closes its client too."""
    model = net()
    opt = rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), cluster=cluster.addresses,
                                   token=cluster.token, model=model, mode="sync", prefix=prefix, rank=0, world_size=1,
                                   chunk_bytes=CHUNK, overlap=True, **options)
    return model, opt


@pytest.mark.parametrize("armed", [False, True], ids=["first-step", "later-step"])
def test_a_gradient_made_twice_in_one_step_is_refused(cluster, armed):
    model, opt = one_rank(cluster, f"twice-{armed}")
    x, y = batches(1)[0]
    try:
        if armed:                          # one good step first: the hooks send from the second
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        loss_of(model, x, y).backward()
        with pytest.raises(OverlapError, match=r"'twice-.*/out\.bias'.*made twice in one step outside no_sync"):
            loss_of(model, x, y).backward()
    finally:
        opt.close()


def test_construction_refusals_change_nothing(cluster):
    client = cluster.client()
    model = net()
    try:
        refusals(client, model)
    finally:
        client.close()


def refusals(client, model) -> None:
    cases = [({"mode": "sync"}, "chunk_bytes > 0"), ({"mode": "async", "chunk_bytes": CHUNK}, "mode 'sync'"),
             ({"mode": "ssp", "chunk_bytes": CHUNK}, "mode 'sync'")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), cluster=client, model=model,
                                     prefix="refused", rank=0, world_size=2, overlap=True, **options)
    assert client.tensors("refused/") == []


def test_gradients_changed_after_backward_are_refused_on_the_first_step_before_anything_is_sent(cluster):
    """torch's clip_grad_norm_ between backward and step(), and a GradScaler: refused at the first
    step with nothing sent (the job applied no step, the model unchanged); opt.clip_grad_norm_
    refused when called."""
    x, y = batches(1)[0]
    for prefix, between in [("clipped", lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)),
                            ("ours", None)]:
        model, opt = one_rank(cluster, prefix)
        before = copy.deepcopy(model.state_dict())
        try:
            loss_of(model, x, y).backward()
            if between is None:
                with pytest.raises(ValueError, match="clip_grad_norm_ with overlap=True"):
                    opt.clip_grad_norm_(1.0)
                continue
            between(model, opt)
            with pytest.raises(OverlapError, match="changed between backward and optimizer.step"):
                opt.step()
            assert opt.client.sync_applied(jobs.job_name(prefix)) == -1
            for name, value in before.items():
                if "running" not in name and "num_batches" not in name:        # forward moved BatchNorm's
                    assert torch.equal(model.state_dict()[name], value), name
        finally:
            opt.close()

    model, opt = one_rank(cluster, "scaled")
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)        # a scale of 1: only the scaler is refused
    try:
        scaler.scale(loss_of(model, x, y)).backward()
        with pytest.raises(OverlapError, match="GradScaler"):
            scaler.step(opt)
        assert opt.client.sync_applied(jobs.job_name("scaled")) == -1
    finally:
        opt.close()


def test_lr_changed_between_backward_and_step_is_told(cluster):
    """The step applies with the lr read when backward began (the same on every rank), and
    step() says so."""
    model, opt = one_rank(cluster, "late-lr")
    x, y = batches(1)[0]
    try:
        for step in range(2):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if step == 1:
                opt.param_groups[0]["lr"] = 0.05
                with pytest.raises(OverlapError, match="hyperparameters changed between backward and"):
                    opt.step()
            else:
                opt.step()
        assert opt.client.sync_applied(jobs.job_name("late-lr")) == 1
        assert opt.step_count == 2
    finally:
        opt.close()
