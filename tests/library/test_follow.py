"""``model.follow(name)``: one gradient's stations down the plain path, on every rank, with values.

The oracle for the values: the gradient each rank saw at its hook, averaged
here with a separate all-reduce, must be what came back and what ``.grad``
holds; the slot must hold the hook's values times 1/N.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minddp import MiniDDP
from minddp.ddp.observers.follow import SHOWN

STATIONS = ["hook", "slot", "launch", "waited", ".grad"]


def _follow(rank, world_size):
    torch.manual_seed(0)
    model = MiniDDP(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)),
                    bucket_cap_mb=1e-4)
    x, y = torch.randn(4, 6) + rank, torch.randn(4, 2)
    F.mse_loss(model(x), y).backward()  # warm-up: the learned order rebuilds the buckets
    followed = model.follow("module.0.weight")  # MiniDDP's name, or the module's ("0.weight")
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    stations = {s: (when, what, values) for when, s, what, values in followed.stations}
    order = [s for _, s, _, _ in sorted(followed.stations, key=lambda t: t[0])]
    hook = torch.tensor(stations["hook"][2], dtype=torch.float64)
    average = hook.clone()
    dist.all_reduce(average)
    average /= world_size
    report = followed.report()
    followed.stop()
    return {
        "order": order, "report": report, "hook": hook.tolist(), "average": average.tolist(),
        "slot": stations["slot"][2], "waited": stations["waited"][2], "grad": stations[".grad"][2],
        "grad_now": model.module[0].weight.grad.reshape(-1)[:SHOWN].double().tolist(),
        "observers_after_stop": [type(o).__name__ for o in model.reducer.observers],
    }


def test_follow_shows_each_station_of_one_gradient_with_its_values(ranks):
    results = ranks(2).run(_follow)
    assert results[0]["hook"] != results[1]["hook"], "each rank's own gradient at the hook"
    for r in results:
        assert r["order"] == STATIONS, r["report"]
        assert r["slot"] == pytest.approx([v / 2 for v in r["hook"]], rel=1e-6)  # times 1/N, before the sum
        assert r["waited"] == pytest.approx(r["average"], rel=1e-5)
        assert r["grad"] == pytest.approx(r["average"], rel=1e-5) and r["grad"] == r["grad_now"]
        assert all(line.split()[1] == "ms" for line in r["report"].splitlines()), r["report"]
        assert r["observers_after_stop"] == [], "stop() takes the observer off"
    assert results[0]["grad"] == results[1]["grad"], "the same average on every rank"


def _unknown(rank, world_size):
    model = MiniDDP(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no parameter named 'weights'.*\['weight', 'bias'\]"):
        model.follow("weights")
    return [type(o).__name__ for o in model.reducer.observers]


def test_follow_names_the_parameters_it_knows(ranks):
    assert ranks(2).run(_unknown) == [["ArrivalOrder", "Policies"]] * 2  # the learned order's, and no Follow
