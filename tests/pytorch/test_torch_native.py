"""A PyTorch user's loop on raftps, unchanged: DistributedOptimizer wrapping torch.optim's own
optimizers (param groups, LR schedulers, clipping, accumulation, GradScaler, autocast,
state_dicts in and out), against a real 3-node cluster, compared with the same loop on plain
torch in one process."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import raftps.torch as rpt  # noqa: E402
from raftps import InvalidRequest, jobs  # noqa: E402

from tests.conftest import start_cluster  # noqa: E402
from tests.pytorch.compare import max_diff, state_diff  # noqa: E402
from tests.pytorch.ranks import run_ranks  # noqa: E402

BASE_PORT = 23300
STEPS = 30
BATCH = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = start_cluster(tmp_path_factory.mktemp("native") / "run", BASE_PORT)
    yield cl
    cl.wipe()


class Net(torch.nn.Module):
    """Linear layers with biases and a LayerNorm: two param groups as nanoGPT makes them."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(10, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(256, 10, generator=g), torch.randint(0, 3, (256,), generator=g)
    return [(x[idx], y[idx]) for idx in (torch.randint(0, 256, (BATCH,), generator=g) for _ in range(steps))]


def warmup_cosine(step: int) -> float:
    return (step + 1) / 5 if step < 5 else 0.5 * (1 + math.cos(math.pi * (step - 5) / STEPS))


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(groups(m, 0.1), lr=3e-2, betas=(0.9, 0.95)),
    "sgd-nesterov": lambda m: torch.optim.SGD(groups(m, 1e-2), lr=0.1, momentum=0.9, nesterov=True),
    "adam-amsgrad": lambda m: torch.optim.Adam(groups(m, 1e-3), lr=1e-2, amsgrad=True),
    "adagrad": lambda m: torch.optim.Adagrad(groups(m, 0.0), lr=0.1),
}
CLIP = 0.5


def train_step(model, opt, x, y, micro: int, clip=None) -> None:
    """One optimizer step over ``micro`` accumulated micro-batches of (x, y), clipped, as a user writes it."""
    opt.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        (torch.nn.functional.cross_entropy(model(xs), ys) / micro).backward()
    if clip is not None:
        clip(model)
    opt.step()


def reference(name: str, data, steps: int = STEPS) -> tuple[torch.nn.Module, dict]:
    model = Net()
    opt = OPTIMIZERS[name](model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    for x, y in data[:steps]:
        train_step(model, opt, x, y, 2, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
        sched.step()
    return model, opt.state_dict()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_wrapped_torch_optimizer_equals_plain_torch(cluster, name, world):
    """Two param groups, warm-up + cosine LambdaLR, clipping and two accumulated micro-batches:
    K sync ranks on 1/K of each batch (clipping the step's mean through the store) equal one
    process on the whole batch with torch.optim and clip_grad_norm_."""
    data = batches(STEPS)
    want, want_state = reference(name, data)
    models = [Net() for _ in range(world)]
    states: dict[int, dict] = {}
    clipped = []

    def body(rank: int) -> None:
        model = models[rank]
        opt = rpt.DistributedOptimizer(OPTIMIZERS[name](model), model=model, cluster=cluster.client(), mode="sync",
                                       prefix=f"native-{name}-{world}", rank=rank, world_size=world)
        assert isinstance(opt, type(OPTIMIZERS[name](Net()))) and isinstance(opt, torch.optim.Optimizer)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        with opt:
            for x, y in data:
                part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
                train_step(model, opt, x[part], y[part], 2, lambda m: opt.clip_grad_norm_(CLIP))
                sched.step()
                if rank == 0:
                    clipped.append(opt.last_grad_norm > CLIP)
            states[rank] = opt.state_dict()
    run_ranks(world, body)
    for rank, model in enumerate(models):
        assert max_diff(model, want) < 1e-5, f"{name} x{world}: differs by {max_diff(model, want)}"
        assert state_diff(states[rank], want_state) < 1e-5, f"{name} x{world}: optimizer state differs"
    assert max_diff(want, Net()) > 1e-2                      # it trained
    assert any(clipped) and not all(clipped), clipped         # clipping acted on some steps, not all


def test_step_with_a_closure_calls_it_once_and_returns_its_loss_as_torch_does(cluster):
    """Lightning's automatic optimization: step(closure) where the closure runs zero_grad, the
    forward and backward. It is called once, with grad enabled even under no_grad, its loss is
    returned, and the parameters equal plain torch's step(closure)."""
    data = batches(5)

    def run(make_opt):
        model = Net()
        opt = make_opt(model)
        calls, losses = [], []
        for x, y in data:
            def closure():
                calls.append(torch.is_grad_enabled())
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            with torch.no_grad():
                losses.append(opt.step(closure).item())
        state = opt.state_dict()
        if hasattr(opt, "close"):
            opt.close()
        return model, calls, losses, state

    want, want_calls, want_losses, want_state = run(OPTIMIZERS["adamw"])
    got, calls, losses, state = run(lambda m: rpt.DistributedOptimizer(OPTIMIZERS["adamw"](m), model=m, mode="sync",
                                                                       cluster=cluster.client(),
                                                                       prefix="native-closure"))
    assert calls == want_calls == [True] * len(data)
    assert np.allclose(losses, want_losses, atol=1e-6), (losses, want_losses)
    assert max_diff(got, want) < 1e-6 and max_diff(want, Net()) > 1e-3
    assert state_diff(state, want_state) < 1e-6


def test_async_mode_carries_the_schedulers_lr(cluster):
    """Async, one worker, pulling every step: each push's lr is the scheduler's, so SGD with a
    StepLR on the store equals torch.optim.SGD with the same StepLR."""
    data = batches(12)

    def loop(model, opt):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for x, y in data:
            train_step(model, opt, x, y, 1)
            sched.step()
        return opt.param_groups[0]["lr"]

    want = Net()
    assert loop(want, torch.optim.SGD(want.parameters(), lr=0.5)) == 0.5 * 0.5 ** 4
    got = Net()
    with rpt.DistributedOptimizer(torch.optim.SGD(got.parameters(), lr=0.5), model=got, cluster=cluster.client(),
                                  mode="async", prefix="native-async-sched") as opt:
        loop(got, opt)
    assert max_diff(got, want) < 1e-6


def test_state_dict_leaves_for_plain_torch_and_arrives_from_it(cluster):
    data = batches(16, seed=5)
    model = Net()
    opt = rpt.DistributedOptimizer(OPTIMIZERS["adamw"](model), model=model, cluster=cluster.client(), mode="sync",
                                   prefix="native-sd-out")
    for x, y in data[:10]:
        train_step(model, opt, x, y, 1)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "step"] and sd["state"][0]["step"].item() == 10
    assert [len(g["params"]) for g in sd["param_groups"]] == [2, 4]
    # leave: a plain AdamW continues from the store's state, as the store would
    plain_model = copy.deepcopy(model)
    plain = OPTIMIZERS["adamw"](plain_model)
    plain.load_state_dict(sd)
    for x, y in data[10:13]:
        train_step(model, opt, x, y, 1)
        train_step(plain_model, plain, x, y, 1)
    assert max_diff(model, plain_model) < 1e-6 and state_diff(opt.state_dict(), plain.state_dict()) < 1e-6
    opt.close()

    # arrive: torch trained 10 steps; its model and state_dict seed a new job, which continues as torch does
    torch_model = Net(seed=7)
    torch_opt = OPTIMIZERS["adamw"](torch_model)
    for x, y in data[:10]:
        train_step(torch_model, torch_opt, x, y, 1)
    arriving = copy.deepcopy(torch_model)
    opt = rpt.DistributedOptimizer(OPTIMIZERS["adamw"](arriving), model=arriving, cluster=cluster.client(),
                                   mode="sync", prefix="native-sd-in")
    opt.load_state_dict(torch_opt.state_dict())
    for x, y in data[10:14]:
        train_step(arriving, opt, x, y, 1)
        train_step(torch_model, torch_opt, x, y, 1)
    assert max_diff(arriving, torch_model) < 1e-6 and state_diff(opt.state_dict(), torch_opt.state_dict()) < 1e-6
    opt.close()


def test_a_mismatched_state_dict_is_refused_and_the_store_unchanged(cluster):
    model = Net()
    opt = rpt.DistributedOptimizer(OPTIMIZERS["adamw"](model), model=model, cluster=cluster.client(), mode="sync",
                                   prefix="native-sd-bad")
    x, y = batches(1)[0]
    train_step(model, opt, x, y, 1)
    good = opt.state_dict()
    before = opt.client.export("native-sd-bad/")["digest"]
    one_group = {"state": good["state"], "param_groups": [dict(good["param_groups"][0], params=list(range(6)))]}
    short = copy.deepcopy(good)
    short["param_groups"][1]["params"] = short["param_groups"][1]["params"][:-1]
    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][0]["exp_avg"] = torch.zeros(3, 3)
    extra = copy.deepcopy(good)
    extra["state"][0]["momentum_buffer"] = torch.zeros(16, 10)
    for bad in (one_group, short, wrong_shape, extra):      # each would also set another lr, were it taken
        bad["param_groups"] = [dict(g, lr=0.123) for g in bad["param_groups"]]
    for bad, message in ((one_group, "1 param groups"), (short, "has 3 parameters"),
                         (wrong_shape, "has shape (3, 3)"), (extra, "'momentum_buffer'"), ({"state": {}}, "torch")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            opt.load_state_dict(bad)
    assert opt.client.export("native-sd-bad/")["digest"] == before
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in good["param_groups"]] != [0.123, 0.123]
    opt.close()


def test_grad_scaler_skips_a_step_with_an_inf_gradient_and_the_store_is_unchanged(cluster):
    """GradScaler on the wrapped optimizer as on plain Adam: a step with an inf gradient changes
    nothing in the store (and halves the scale), the finite steps after it are unscaled and equal
    plain torch's, parameters and Adam's state."""
    data = batches(3, seed=17)

    def loop(model, opt, after_inf=None):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            if i == 0:
                model.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            if i == 0 and after_inf is not None:
                after_inf()
        return scaler.get_scale()

    want = Net()
    want_opt = torch.optim.Adam(want.parameters(), lr=1e-2)
    want_scale = loop(want, want_opt)
    model = Net()
    opt = rpt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model=model,
                                   cluster=cluster.client(), mode="sync", prefix="native-scaler")
    versions = lambda: opt.client.export("native-scaler/")["tensor_versions"]   # noqa: E731
    before = versions()
    unchanged = []
    scale = loop(model, opt, lambda: unchanged.append(versions() == before and max_diff(model, Net()) == 0.0))
    assert unchanged == [True]                                # the skipped step reached nothing
    assert scale == want_scale == 2.0 ** 7
    assert all(v == before[k] + len(data) - 1 for k, v in versions().items())
    assert max_diff(model, want) < 1e-6 and max_diff(want, Net()) > 1e-3
    assert state_diff(opt.state_dict(), want_opt.state_dict()) < 1e-6
    opt.close()


def test_autocast_bfloat16_and_a_compiled_model_train_as_plain_torch(cluster):
    data = batches(6, seed=9)

    def loop(model, opt):
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

    want = Net()
    want_opt = torch.optim.AdamW(want.parameters(), lr=1e-2)
    loop(want, want_opt)
    got = Net()
    compiled = torch.compile(got, backend="eager")
    with rpt.DistributedOptimizer(torch.optim.AdamW(compiled.parameters(), lr=1e-2), model=compiled,
                                  cluster=cluster.client(), mode="sync", prefix="native-amp") as opt:
        loop(compiled, opt)
        names = sorted(opt.client.export("native-amp/")["tensors"])
        state = opt.state_dict()
    assert names == sorted(f"native-amp/{n}" for n, _ in Net().named_parameters())   # the uncompiled names
    assert max_diff(got, want) < 1e-5 and state_diff(state, want_opt.state_dict()) < 1e-5


def test_ranks_with_different_schedulers_are_refused_by_name_and_the_other_rank_steps_alone(cluster):
    """Two sync ranks whose LR schedulers disagree (rank 1 halves its lr each step, rank 0 keeps
    it): step 0 applies with both; at step 1 whichever rank arrives second is refused by name, and
    the first rank's step applies alone after step_timeout, as one torch SGD step on its own
    gradient with its own lr."""
    models = [Net() for _ in range(2)]
    outcome: dict[int, object] = {}
    before: dict[int, tuple[dict, dict, float]] = {}      # rank -> (parameters, gradients, lr) at step 1
    x, y = batches(1, seed=19)[0]

    def body(rank: int) -> None:
        model = models[rank]
        with rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, mode="sync",
                                      cluster=cluster.client(), prefix="native-hyper", rank=rank, world_size=2,
                                      step_timeout=2.0) as opt:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5 if rank else 1.0)
            for step in range(2):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]).backward()
                if step == 1:
                    before[rank] = ({n: p.detach().clone() for n, p in model.named_parameters()},
                                    {n: p.grad.clone() for n, p in model.named_parameters()}, opt.param_groups[0]["lr"])
                try:
                    opt.step()
                    outcome[rank] = "applied"
                except InvalidRequest as exc:
                    outcome[rank] = exc
                sched.step()
    run_ranks(2, body)
    refused = [r for r, o in outcome.items() if isinstance(o, InvalidRequest)]
    assert len(refused) == 1 and "lr" in str(outcome[refused[0]]) and "same LR scheduler" in str(outcome[refused[0]])
    alone = 1 - refused[0]
    assert outcome[alone] == "applied" and [before[r][2] for r in (0, 1)] == [0.1, 0.05]
    params, grads, lr = before[alone]
    for name, p in models[alone].named_parameters():           # one SGD step on its gradient alone
        assert (p - (params[name] - lr * grads[name])).abs().max().item() < 1e-6, name
    for name, p in models[refused[0]].named_parameters():      # the refusal changed nothing here
        assert torch.equal(p, before[refused[0]][0][name]), name
    with cluster.client() as c:
        assert c.sync_applied(jobs.job_name("native-hyper")) == 1


def test_bad_input_is_refused_clearly_before_any_io(cluster):
    model = Net()
    with pytest.raises(ValueError, match="SGD, Adam, AdamW, Adagrad.*RMSprop.*diloco"):
        rpt.DistributedOptimizer(torch.optim.RMSprop(model.parameters()), model=model, cluster=cluster.client())
    class ClippingAdamW(torch.optim.AdamW):          # its own step(): the store would run AdamW's instead
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
            return super().step(closure)
    with pytest.raises(ValueError, match="ClippingAdamW defines its own step.*AdamW.*diloco"):
        rpt.DistributedOptimizer(ClippingAdamW(model.parameters()), model=model, cluster=cluster.client())
    with pytest.raises(ValueError, match="lr_decay"):
        rpt.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr_decay=0.1), model=model,
                                 cluster=cluster.client())
    with pytest.raises(ValueError, match="model="):
        rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), cluster=cluster.client())
    with pytest.raises(ValueError, match="not a parameter of the model"):
        rpt.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), model=model, cluster=cluster.client())
    with pytest.raises(TypeError, match="nn.Module"):
        rpt.DistributedOptimizer("model", cluster=cluster.client())
    opt = rpt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                                   cluster=cluster.client(), mode="sync", prefix="native-bad")
    with pytest.raises(TypeError, match="closure must be callable"):
        opt.step(0.0)
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(0)
    opt.param_groups[0]["nesterov"] = True
    with pytest.raises(ValueError, match="nesterov"):
        opt.step()
    opt.close()


def test_export_format_torch_loads_in_plain_torch_and_imports_back(cluster, tmp_path):
    """`raftps export --format torch` writes {"model", "optimizer"} that torch.load(weights_only=True)
    reads and a plain AdamW continues from; `raftps import` of it seeds a new job with that state."""
    import os
    import subprocess
    import sys
    from raftps.tools.model_files import import_model

    model = Net()
    with rpt.DistributedOptimizer(OPTIMIZERS["adamw"](model), model=model, cluster=cluster.client(), mode="sync",
                                  prefix="native-ckpt") as opt:
        for x, y in batches(4, seed=11):
            train_step(model, opt, x, y, 1)
    path = tmp_path / "job.pt"
    env = {**os.environ, **cluster.client_env}
    done = subprocess.run([sys.executable, "-m", "raftps", "export", str(path), "--prefix", "native-ckpt",
                           "--format", "torch"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ckpt = torch.load(path, weights_only=True)
    assert sorted(ckpt["model"]) == sorted(n for n, _ in model.named_parameters())
    groups_ = ckpt["optimizer"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups_) == [0.0, 0.1] and ckpt["raftps"]["class"] == "AdamW"
    plain_model = Net(seed=3)
    plain_model.load_state_dict(ckpt["model"])
    by_name = dict(plain_model.named_parameters())
    plain = torch.optim.AdamW([{"params": [by_name[n] for n in g["param_names"]]} for g in groups_])
    plain.load_state_dict(ckpt["optimizer"])
    assert max_diff(plain_model, model) == 0.0
    x, y = batches(1, seed=12)[0]
    with rpt.DistributedOptimizer(OPTIMIZERS["adamw"](model), model=model, cluster=cluster.client(), mode="sync",
                                  prefix="native-ckpt") as opt:
        train_step(model, opt, x, y, 1)
    train_step(plain_model, plain, x, y, 1)
    assert max_diff(plain_model, model) < 1e-6

    with cluster.client() as c:
        summary = import_model(c, str(path), "native-ckpt-copy", None)
        assert summary["states"] == 6 and summary["created"] == 6
        copied = c.export("native-ckpt-copy/", state=True)
        original = torch.load(path, weights_only=True)
        for short, value in original["model"].items():
            assert np.array_equal(copied["tensors"][f"native-ckpt-copy/{short}"], value.numpy())
            assert copied["states"][f"native-ckpt-copy/{short}"]["step"] == 4


def test_step_hyperparameters_are_what_changed_and_fixed_options_stay():
    """What a step carries for a group: only what differs from the stored spec (nothing for a
    constant lr); staleness_aware is raftps's own and never compared with torch's options."""
    from raftps.torch import optimizers
    group = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True}
    stored = {**optimizers.stored_spec(torch.optim.AdamW, group), "staleness_aware": True}
    assert optimizers.step_hyperparameters(optimizers.store_spec(torch.optim.AdamW, group), stored) == {}
    assert optimizers.step_hyperparameters(optimizers.store_spec(torch.optim.AdamW, {**group, "lr": 0.05}),
                                           stored) == {"lr": 0.05}
    with pytest.raises(ValueError, match="amsgrad"):
        optimizers.step_hyperparameters(optimizers.store_spec(torch.optim.AdamW, {**group, "amsgrad": True}), stored)


def test_clip_grad_norm_returns_torchs_norm_without_torch_2_6_apis(cluster, monkeypatch):
    """pyproject declares torch>=2.1: sync mode's clip_grad_norm_ must not need
    torch.nn.utils.get_total_norm (2.6+). Without it, it returns the norm torch's own
    clip_grad_norm_ computes for the same gradients."""
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
    x, y = batches(1, seed=13)[0]
    plain = Net()
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
    model = Net()
    with rpt.DistributedOptimizer(OPTIMIZERS["adamw"](model), model=model, cluster=cluster.client(), mode="sync",
                                  prefix="native-norm") as opt:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        got = opt.clip_grad_norm_(CLIP)
        opt.step()
        assert got.item() == pytest.approx(want.item(), rel=1e-6) and want.item() > CLIP
        assert opt.last_grad_norm == pytest.approx(want.item(), rel=1e-5)
