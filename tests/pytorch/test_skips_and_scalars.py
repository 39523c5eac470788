"""Two torch-adapter gaps (issue 36): a sync step one rank's GradScaler skips (an inf in that
rank's gradient) is skipped by every rank, as DDP skips it; and a model with a 0-d parameter and
a 0-d buffer (GPT-2's ``masked_bias``) trains on the store as on plain torch. A real 3-node
cluster; ranks in threads."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps.tools.model_files import export_model, read_model  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.compare import max_diff, state_diff  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402

BASE_PORT = 26200
GROUPED_PORT = 27300
STEPS = 4
SKIPPED = 1          # the step whose gradient holds an inf
SCALE = 2.0 ** 8
GROWTH_INTERVAL = 3  # the scale doubles after 3 finite steps in a row: within STEPS unless the skip resets the count


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("skips") / "run", BASE_PORT)
    yield cl
    cl.wipe()


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """Three Raft groups: the model's tensors, so each step's parts, spread over them."""
    cl = start_cluster(tmp_path_factory.mktemp("skips-groups") / "run", GROUPED_PORT, groups=3)
    yield cl
    cl.wipe()


class Scalars(torch.nn.Module):
    """A Linear layer, a 0-d parameter (a learned gain) and a 0-d float buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 3)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("masked_bias", torch.tensor(-1e4))

    def forward(self, x):
        return self.fc(x) * self.gain + self.masked_bias * 0.0


def batches(n: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)) for _ in range(n)]


def amp_loop(model, opt, data, poison, after_step=None) -> tuple[dict, float]:
    """The torch AMP loop with a per-step LR scheduler; ``poison(i)``: put an inf in step i's
    gradient. Returns (the scaler's state_dict: scale and growth count, the scheduler's lr) at the end."""
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=GROWTH_INTERVAL)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if poison(i):
            model.fc.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        sched.step()
        if after_step is not None:
            after_step(i)
    return scaler.state_dict(), sched.get_last_lr()[0]


@pytest.mark.parametrize("where", ["cluster", "grouped"])
def test_a_step_one_rank_skips_is_skipped_by_every_rank(where, request):
    """Rank 0's gradient holds an inf at step 1, rank 1's does not: as under DDP (where the
    all-reduced gradient holds the inf on every rank) the step changes nothing in the store, both
    ranks stay in step, and the run equals one process on the full batch whose step 1 overflowed
    (with three Raft groups too: each group's part of the step is skipped). Every rank's
    GradScaler ends as the reference's, which saw the full batch's inf as each DDP rank's does
    (the all-reduced gradient): rank 1, whose own gradients were finite, backs off too instead of
    counting the step finite and doubling its scale (GROWTH_INTERVAL)."""
    cluster = request.getfixturevalue(where)
    data = batches(STEPS, 32)
    want = Scalars()
    want_opt = torch.optim.Adam(want.parameters(), lr=1e-2)
    want_scale, want_lr = amp_loop(want, want_opt, data, lambda i: i == SKIPPED)

    prefix, opts, ends, versions = f"skip2-{where}", {}, {}, {}
    # Made here, not in the ranks' threads: Scalars() seeds torch's global generator, which the
    # threads share, so two models built at once drew each other's numbers (about one run in six
    # rank 0 made the job's tensors from an initialisation 0.6 from `want`'s).
    models = {rank: Scalars() for rank in (0, 1)}

    def body(rank: int) -> None:
        model = models[rank]
        opt = rpt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model=model,
                                       cluster=cluster.client(), mode="sync", prefix=prefix, rank=rank,
                                       world_size=2, step_timeout=30.0)
        shards = [(x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]) for x, y in data]
        seen = []

        def after(i: int) -> None:      # the parameters' versions (a skipped step still adds the buffers' drift)
            stored = opt.client.export(prefix + "/")["tensor_versions"]
            seen.append((opt.step_count, opt.last_step_skipped, {n: stored[f"{prefix}/{n}"] for n, _ in model.named_parameters()}))
        ends[rank] = amp_loop(model, opt, shards, lambda i: rank == 0 and i == SKIPPED, after)
        opts[rank], versions[rank] = opt, seen

    run_ranks(2, body, timeout=120.0)
    flags = [n for n in opts[0].client.export(prefix + "/")["tensor_versions"] if "/_raftps/skip" in n]
    assert len(flags) == 1 if where == "cluster" else len(flags) >= 2      # one per Raft group the step spans
    for rank in (0, 1):
        assert [count for count, _, _ in versions[rank]] == list(range(1, STEPS + 1))   # in step
        assert [skipped for _, skipped, _ in versions[rank]] == [i == SKIPPED for i in range(STEPS)]
        assert versions[rank][SKIPPED][2] == versions[rank][SKIPPED - 1][2]     # no parameter changed
        assert max_diff(models[rank], want) < 1e-5
        assert state_diff(opts[rank].state_dict(), want_opt.state_dict()) < 1e-5
        assert ends[rank][1] == pytest.approx(want_lr)
    assert max_diff(want, Scalars()) > 1e-3
    # both ranks' scalers back off at the skipped step and count again from 0, as DDP's ranks'
    assert want_scale["scale"] == SCALE / 2 and want_scale["_growth_tracker"] == STEPS - 1 - SKIPPED
    assert ends[0][0] == ends[1][0] == want_scale
    for opt in opts.values():
        opt.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_0d_parameter_and_buffer_train_as_plain_torch(cluster, mode, tmp_path):
    """...and `raftps export` writes them 0-d: the file loads into the model."""
    data = batches(5)
    want = Scalars()
    want_opt = torch.optim.Adam(want.parameters(), lr=1e-2)
    model = Scalars()
    opt = rpt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model=model,
                                   cluster=cluster.client(), mode=mode, prefix=f"scalar-{mode}")
    clips = (lambda: torch.nn.utils.clip_grad_norm_(want.parameters(), 0.5), lambda: opt.clip_grad_norm_(0.5))
    for m, o, clip in ((want, want_opt, clips[0]), (model, opt, clips[1])):
        for x, y in data:
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            clip()           # clipped (the norms are above 0.5): sync clips in the store
            o.step()
    opt.flush()
    assert model.gain.shape == () and model.masked_bias.shape == ()
    assert max_diff(model, want) < 1e-6 and abs(want.gain.item() - 1.5) > 1e-3
    assert state_diff(opt.state_dict(), want_opt.state_dict()) < 1e-6
    again = Scalars()          # a second worker resumes the store's values, shapes kept
    opt2 = rpt.DistributedOptimizer(torch.optim.Adam(again.parameters(), lr=1e-2), model=again,
                                    cluster=cluster.client(), mode=mode, prefix=f"scalar-{mode}")
    assert max_diff(again, want) < 1e-6
    opt2.close()
    path = tmp_path / "model.safetensors"
    export_model(opt.client, f"scalar-{mode}", "safetensors", str(path))
    exported = Scalars()        # strict: names and shapes
    exported.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in read_model(str(path))[0].items()})
    assert max_diff(exported, want) < 1e-6
    opt.close()
