"""A write's per-step hyperparameters (a torch param group's lr, betas, ...), a sync step's
clipping factor, and assign_state (optimizer state seeded from a torch state_dict), on the pure
state machine: applied as given, refused whole and changing nothing when wrong."""
import numpy as np
import pytest

from raftps import optim
from raftps.server.aggregate import clip_scale
from tests.test_machine import F32, Log, make


def _adam(log, name="w", **extra):
    return make(log, name, spec={"name": "adam", "lr": 0.1, **extra})


def test_push_hyper_sets_this_steps_values_and_leaves_the_stored_spec():
    log = Log()
    _adam(log)
    grad = np.array([1, -2, 3, 0.5], F32)
    assert "error" not in log("push", tensors={"w": grad}, hyper={"w": {"lr": 0.01, "beta1": 0.5}})
    spec = optim.normalize({"name": "adam", "lr": 0.01, "beta1": 0.5})
    want, _ = optim.step(spec, np.zeros(4, F32), grad, optim.init_state(spec, np.zeros(4, F32)))
    t = log.store.tensors["w"]
    assert t.data.tobytes() == want.tobytes()
    assert t.optimizer["lr"] == 0.1 and t.optimizer["beta1"] == 0.9      # the defaults stay stored
    assert t.state["step"] == 1


@pytest.mark.parametrize("hyper, message", [
    ({"w": {"lr": -1.0}}, "adam.lr must be > 0"),
    ({"w": {"momentum": 0.9}}, "cannot set 'momentum'"),
    ({"w": {"nesterov": True}}, "cannot set 'nesterov'"),
    ({"v": {"lr": 0.1}}, "which this write does not update"),
    ({"w": {"lr": 0.1}, "v": {"lr": 0.1}}, "which this write does not update"),
    ([0.1], "'hyper' must be a map"),
])
def test_bad_hyper_refuses_the_whole_push_and_changes_nothing(hyper, message):
    log = Log()
    _adam(log)
    make(log, "u", spec={"name": "sgd", "lr": 1.0})
    result = log("push", tensors={"w": np.ones(4, F32), "u": np.ones(4, F32)}, hyper=hyper)
    assert "error" in result and message in result["message"], result
    for t in log.store.tensors.values():      # neither tensor moved
        assert t.version == 0 and not t.data.any()


def test_step_entry_applies_scale_and_hyper_to_the_mean():
    log = Log()
    make(log, spec={"name": "momentum", "lr": 1.0, "momentum": 0.5})
    sums = np.array([4, 0, 0, 0], F32)          # two contributions: mean [2, 0, 0, 0]
    result = log("step", job="job", step=0, workers=2, count=2, contributors=[["a", 1, 1, True], ["b", 1, 1, True]],
                 tensors={"w": sums}, scale=0.25, hyper={"w": {"lr": 0.5}})
    assert result["applied"], result
    # mean 2 * 0.25 = 0.5; velocity 0.5; param -= 0.5 * 0.5
    assert log.store.tensors["w"].data.tolist() == [-0.25, 0, 0, 0]


def test_step_entry_with_a_bad_scale_is_refused():
    log = Log()
    make(log)
    for scale in (0.0, 1.5, 1, "x"):
        result = log("step", job="job", step=0, workers=1, count=1, contributors=[["a", 1, 1, True]],
                     tensors={"w": np.ones(4, F32)}, scale=scale)
        assert "error" in result and "scale" in result["message"]
    assert log.store.tensors["w"].version == 0


@pytest.mark.parametrize("max_norm", [0.3, 100.0])
def test_clip_scale_is_torchs_clip_grad_norm(max_norm):
    """The step's clipping against torch.nn.utils.clip_grad_norm_ on the mean of the same two
    contributions: the same total norm, and the scaled mean equals torch's clipped gradients
    (max_norm 0.3 clips, 100 does not)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    contributions = [{"a": rng.normal(size=(3, 4)).astype(F32), "b": rng.normal(size=5).astype(F32)} for _ in range(2)]
    sums = {name: contributions[0][name] + contributions[1][name] for name in ("a", "b")}
    scale, norm = clip_scale(sums, 2, max_norm)
    params = {name: torch.nn.Parameter(torch.zeros(sums[name].shape)) for name in sums}
    for name, p in params.items():
        p.grad = (torch.from_numpy(contributions[0][name]) + torch.from_numpy(contributions[1][name])) / 2
    want_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    assert norm == pytest.approx(want_norm.item(), rel=1e-6)
    assert (scale < 1.0) == (max_norm < norm)
    for name, p in params.items():
        np.testing.assert_allclose(sums[name] / 2 * F32(scale), p.grad.numpy(), rtol=1e-6, atol=1e-7)


def _adam_state(step=3, fill=0.5):
    return {"m": np.full(4, fill, F32), "v": np.full(4, fill, F32), "beta1_t": 0.9 ** step,
            "beta2_t": 0.999 ** step, "step": step}


def _assign_state(log, values, states):
    records, parts = [], {}
    for i, name in enumerate(sorted(values)):
        records.append({"name": name, "scalars": {k: v for k, v in states[name].items()
                                                  if not isinstance(v, np.ndarray)}})
        parts[str(i)] = values[name]
        parts.update({f"{i}.{k}": v for k, v in states[name].items() if isinstance(v, np.ndarray)})
    return log("assign_state", records=records, tensors=parts)


def test_assign_state_sets_values_and_state_then_steps_continue_from_them():
    log = Log()
    _adam(log)
    value = np.array([1, 2, 3, 4], F32)
    assert _assign_state(log, {"w": value}, {"w": _adam_state()})["assigned"] == ["w"]
    t = log.store.tensors["w"]
    assert t.data.tobytes() == value.tobytes() and t.state["step"] == 3 and t.version == 1
    grad = np.ones(4, F32)
    log("push", tensors={"w": grad})
    want, _ = optim.step(t.optimizer, value, grad, _adam_state())
    assert log.store.tensors["w"].data.tobytes() == want.tobytes()
    assert log.store.tensors["w"].state["step"] == 4


@pytest.mark.parametrize("state, message", [
    ({k: v for k, v in _adam_state().items() if k != "v"}, "keeps state"),
    ({**_adam_state(), "extra": np.zeros(4, F32)}, "keeps state"),
    ({**_adam_state(), "m": np.zeros(3, F32)}, "shape"),
    ({**_adam_state(), "m": np.zeros(4, np.float64)}, "dtype"),
    ({**_adam_state(), "m": np.array([1, np.nan, 0, 0], F32)}, "NaN/Inf"),
    ({**_adam_state(), "step": -1}, "int >= 0"),
    ({**_adam_state(), "beta1_t": 0.0}, "(0, 1]"),
])
def test_assign_state_refuses_a_mismatched_state_and_changes_nothing(state, message):
    log = Log()
    _adam(log)
    _adam(log, "u")
    good = {"u": _adam_state()}
    result = _assign_state(log, {"u": np.ones(4, F32), "w": np.ones(4, F32)}, {**good, "w": state})
    assert "error" in result and message in result["message"], result
    # u, checked first and valid, was not assigned either: the write applies whole or not at all
    for t in log.store.tensors.values():
        assert t.version == 0 and not t.data.any() and t.state["step"] == 0 and not t.state["m"].any()


def test_hyper_validation_does_not_depend_on_what_was_validated_before():
    """True == 1 in Python: a replica that validated lr=1 must still refuse lr=True, as a fresh
    replica does, or the replicas' answers (and states) would differ."""
    spec = optim.normalize({"name": "sgd", "lr": 0.5})
    assert optim.with_hyperparameters(spec, {"lr": 1})["lr"] == 1.0
    with pytest.raises(Exception, match="finite number"):
        optim.with_hyperparameters(spec, {"lr": True})
    assert optim.with_hyperparameters(spec, {"lr": 0})["lr"] == 0.0
