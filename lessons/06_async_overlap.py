"""Lesson 06: overlap communication with backward -- asynchronous all_reduce.

What you will learn
    In lesson 05 each hook *waited* for its all_reduce, so backward stood
    still while gradients travelled. But the last layer's gradient is final
    long before the first layer's is computed. An asynchronous all_reduce
    returns at once with a *future*; the sum travels while autograd carries
    on with the earlier layers. Before the optimizer step we ``wait()`` for
    every future and divide.

    The difference from lesson 05: the hook launches instead of waiting, and
    ``finish_gradient_synchronization()`` comes back to wait and divide.
    That is all of ``AsyncDDP`` (``diff lessons/wrappers/hook_ddp.py
    lessons/wrappers/async_ddp.py``); the notes this lesson takes for its
    picture and its timing live in a subclass here, ``WatchedAsyncDDP``.
    (Torch's DDP and MiniDDP call that for you at the end of backward, lesson
    07b; here it is explicit so you can see it.)

    A laptop's loopback "network" costs microseconds, so overlap would hide
    almost nothing there. The all-reduces therefore go through a *simulated
    link* (``minddp_lab.simulated_link``): the real sum, delivered after the time
    the alpha-beta model of ``minddp_lab.network`` gives -- per message
    ``2(p-1) alpha + 2(p-1)/p * bytes / bandwidth`` for a ring, one message
    on the wire at a time. Preset ``laptop``: alpha 2 ms, 200 MB/s.

What to run
    python lessons/06_async_overlap.py [--world-size 3] [--wait-in-hook] [--link eth25|none]
    It compares ranks, so it needs two or more: ``--world-size 1`` stops
    with one line saying so.

What to look at
    The saving, the lesson's one answer: the same wrapper waiting in the
    hook (lesson 05's behaviour, no overlap) and not waiting (overlap),
    both replayed in the link model's time -- this machine's backward as it
    ran (when each hook fired), each message on the wire for the time the
    alpha-beta model gives it. No clock figure is shown with a link: on a
    shared machine the clock also counts the other programs and a peer
    arriving late, and the model does not. Then the timeline of that same
    backward on rank 0, in the model's time (``--wait-in-hook`` and
    ``--link none``: the fastest of the timed backwards, the one whose time is
    printed, by the clock): when each parameter's
    hook fired (``^``), while its all-reduce waited for the wire (``.``) and
    was on it (``=``), and where backward returned (``|``). The count of
    all-reduces that end during backward is read off that drawing.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict the saving before running: overlap hides the shorter of
       backward and communication behind the longer, so expect up to about
       min(backward time, time on the wire); the lesson prints both.
    2. ``--wait-in-hook`` draws the waiting variant's timeline instead.
       Predict its shape.
    3. ``--link none``: plain Gloo over loopback. Predict the saving.
"""

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import FEATURES, add_link_option, is_exact, make_link, parse_args, print0, print_results, run, train_and_compare
from wrappers.async_ddp import AsyncDDP  # this lesson's wrapper: diff it with wrappers/hook_ddp.py


class WatchedAsyncDDP(AsyncDDP):
    """AsyncDDP taking notes for the picture and the timing: when forward ended,
    when each hook launched and each sum arrived, when backward returned. With
    ``wait_in_hook`` each hook waits for its sum: lesson 05's behaviour."""

    def __init__(self, module: nn.Module, link=None, wait_in_hook: bool = False, broadcast: bool = True):
        super().__init__(module, link, broadcast)
        self.wait_in_hook = wait_in_hook
        self.names = {p: n for n, p in module.named_parameters()}
        self.timeline = []  # [name, launched at, finished at, link message or None] per hook
        self.backward_and_sync_ms = []  # per step, from the end of forward to every sum in

    def forward(self, *args, **kwargs):
        self.timeline.clear()
        output = super().forward(*args, **kwargs)
        self.forward_done = time.perf_counter()
        return output

    def _average_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        entry = [self.names[param], time.perf_counter(), None, None]  # stamped before the launch
        super()._average_grad(param)
        future = self.pending[-1][1]
        if self.link is not None:
            entry[3] = self.link.messages[-1]  # when the wire took it, and the model's duration
        self.timeline.append(entry)
        future.then(lambda _, entry=entry: note_finish(entry))
        if self.wait_in_hook:  # backward stands still until the sum is in
            future.wait()
            note_finish(entry)

    def finish_gradient_synchronization(self) -> None:
        self.backward_done = time.perf_counter()
        super().finish_gradient_synchronization()
        for entry in self.timeline:
            note_finish(entry)  # a callback may not have run yet: the sum is in by now
        self.all_done = time.perf_counter()
        if self.timeline:
            self.backward_and_sync_ms.append(1e3 * (self.all_done - self.forward_done))


def note_finish(entry: list) -> None:
    if entry[2] is None:  # the first to see the sum complete: a callback, or the waiter
        entry[2] = time.perf_counter()


def modelled(ddp: WatchedAsyncDDP) -> dict:
    """The last backward replayed in the link model's time: compute as it ran
    here (when each hook fired, when backward returned), communication as the
    model says (each message on the wire for its modelled time, one at a
    time), not as the clock saw it: a late peer or a slow real sum cannot move
    it. A busy machine moves when the hooks fire, so the saving is no
    constant; what holds for any timing of the hooks is below.
    ``rows`` keeps each all-reduce's (name, launched, on the wire, done) in ms, for ``draw``;
    ``hidden`` counts those done before backward returned, ``hidden_wire`` their time on the wire.

    Whatever the hooks' timing, ``hidden_wire <= waiting - overlap <= min(backward, wire)``: the
    all-reduces that end under backward are saved whole (those after them queue from when
    backward returned at the latest), and no more can hide than backward or the wire lasts."""
    t0 = ddp.forward_done
    backward = 1e3 * (ddp.backward_done - t0)
    wire_free, rows = 0.0, []
    for name, launched, _, message in ddp.timeline:
        at = 1e3 * (launched - t0)
        on_wire = max(at, wire_free)
        wire_free = on_wire + 1e3 * message.predicted_s
        rows.append((name, at, on_wire, wire_free))
    wire = sum(1e3 * m.predicted_s for *_, m in ddp.timeline)
    hidden = [done - on_wire for _, _, on_wire, done in rows if done < backward]
    return dict(backward=backward, wire=wire, waiting=backward + wire,  # every message waited for in turn
                overlap=max(backward, wire_free), hidden=len(hidden), hidden_wire=sum(hidden), rows=rows)


def clock_rows(ddp: WatchedAsyncDDP) -> tuple[list, float, float]:
    """The last backward as the clock saw it: (rows in ms as ``modelled``'s, backward returned, all done)."""
    t0 = ddp.forward_done
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    rows = [(name, ms(launched), ms(m.started if m is not None and m.started is not None else launched), ms(finished))
            for name, launched, finished, m in ddp.timeline]
    return rows, ms(ddp.backward_done), ms(ddp.all_done)


def draw(rows: list, backward_ms: float, total_ms: float, width: int = 56) -> None:
    scale = width / total_ms
    col = lambda t: min(width - 1, int(t * scale))  # noqa: E731
    end_col = col(backward_ms)
    print0(f"  {'parameter':<10} 0 ms{' ' * (width - 14)}{total_ms:6.1f} ms")
    for name, launched, on_wire, finished in rows:
        row = [" "] * width
        for c in range(col(launched), col(finished) + 1):
            row[c] = "." if c < col(on_wire) else "="
        row[col(launched)] = "^"
        if row[end_col] != "^":  # a hook that fired as backward returned keeps its mark
            row[end_col] = "|"
        print0(f"  {name:<10} {''.join(row)}")
    print0(f"  ^ hook fired, all_reduce launched   . queued   = on the wire   | backward returned at {backward_ms:.1f} ms")


def time_alternately(wrappers: list, per_rank: int, rounds: int = 6) -> tuple[list[float], dict | None, list]:
    """Backward + sync, the part overlap can shorten, one step of each wrapper in
    turn; with a link, the link model's replay of the overlapping wrapper's
    least disturbed round (its shortest backward), which is the lesson's
    answer. Without a link, only the clock: the fastest step of each (a busy
    machine can only add time), for the learner to look at, never to check.
    Also, per wrapper, that fastest step's backward as the clock saw it
    (``clock_rows``), so that what is drawn is the step whose time is printed."""
    x = torch.randn(per_rank, FEATURES)
    replays, seen = [], [[] for _ in wrappers]
    for _ in range(rounds):
        for ddp, steps in zip(wrappers, seen):
            ddp.zero_grad()
            dist.barrier()
            ddp(x).sum().backward()
            ddp.finish_gradient_synchronization()
            steps.append((ddp.backward_and_sync_ms[-1], clock_rows(ddp)))
        if wrappers[-1].link is not None:
            replays.append(modelled(wrappers[-1]))
    model = min(replays, key=lambda r: r["backward"]) if replays else None
    fastest = [min(steps, key=lambda step: step[0]) for steps in seen]
    return [ms for ms, _ in fastest], model, [rows for _, rows in fastest]


def main(rank: int, world_size: int, args) -> None:
    # 2048 samples per rank: a backward about as long as the wire is busy,
    # so that overlap has the most to hide. The table and the timing use it.
    bench = dict(width=256, depth=4, per_rank=2048, steps=3)
    waiting, ddp_waiting = train_and_compare("waits in the hook (05)", lambda m: WatchedAsyncDDP(m, make_link(args.link), True), rank, world_size, **bench)
    overlap, ddp_overlap = train_and_compare("async, waits at the end (06)", lambda m: WatchedAsyncDDP(m, make_link(args.link)), rank, world_size, **bench)
    print0(f"{world_size} ranks, link {args.link}, {bench['per_rank']} samples per rank; the same wrapper, waiting in the hook or at the end:")
    print_results([waiting, overlap])
    (slow, fast), model, (slow_rows, fast_rows) = time_alternately([ddp_waiting, ddp_overlap],
                                                                   per_rank=bench["per_rank"])
    if model is None:
        print0(f"  no link, so no model: by the clock on this machine (fastest of 6 alternating steps, rank 0; it also")
        print0(f"  counts whatever else runs here, so it is not checked): backward + sync {slow:.1f} ms waiting in the")
        print0(f"  hook, {fast:.1f} ms with overlap")
    else:
        most = min(model["backward"], model["wire"])
        print0(f"\nthe saving, in the link model's time: the least disturbed of 6 backwards ({model['backward']:.1f} ms here),")
        print0(f"  its {len(ddp_overlap.timeline)} all-reduces on the wire for {model['wire']:.1f} ms by the alpha-beta model:")
        print0(f"  {model['waiting']:.1f} ms waiting in the hook, {model['overlap']:.1f} ms with overlap: saved "
               f"{model['waiting'] - model['overlap']:.1f} ms ({1 - model['overlap'] / model['waiting']:.0%}); "
               f"at most min(backward, wire) = {most:.1f} ms,")
        print0(f"  at least the {model['hidden_wire']:.1f} ms on the wire of the {model['hidden']} all-reduces "
               f"that end while backward runs")

    shown = ddp_waiting if args.wait_in_hook else ddp_overlap
    if model is not None and not args.wait_in_hook:  # the very backward the saving comes from, in the model's time
        print0(f"\nrank 0, that least disturbed backward with overlap, {len(model['rows'])} parameters, in the link "
               f"model's time:")
        draw(model["rows"], model["backward"], model["overlap"])
        drawn_in_backward = sum(done < model["backward"] for *_, done in model["rows"])
        assert drawn_in_backward == model["hidden"], "the drawing and the count below are of the same backward"
    elif rank == 0:  # the step whose time is printed above: the fastest of the 6 (a busy machine only adds time)
        print(f"\nrank 0, the fastest of those 6 backwards {'waiting in the hook' if args.wait_in_hook else 'with overlap'}, "
              f"{len(shown.timeline)} parameters, by the clock:")
        draw(*(slow_rows if args.wait_in_hook else fast_rows))
    assert is_exact(waiting) and is_exact(overlap), "when a sum arrives does not change what it is"
    first_name = shown.timeline[0][0]
    assert first_name.split(".")[0] == str(len(shown.module) - 1), f"backward reaches the last layer first, not {first_name}"
    finished_in_backward = sum(finished < shown.backward_done for _, _, finished, _ in shown.timeline)
    if args.wait_in_hook:
        assert finished_in_backward == len(shown.timeline), (
            f"each hook waited, so all {len(shown.timeline)} all-reduces end inside backward; {finished_in_backward} did")
        assert all(f <= nxt for (_, _, f, _), (_, nxt, _, _) in zip(shown.timeline, shown.timeline[1:])), (
            "each all-reduce ends before the next hook fires")
    if model is not None and rank == 0:
        saved = model["waiting"] - model["overlap"]
        assert model["hidden"] > 0, f"in the model some all-reduce ends under backward; none of {len(shown.timeline)} did"
        assert model["hidden_wire"] - 1e-9 <= saved <= most + 1e-9, (
            f"in the model overlap saves every all-reduce that ends under backward ({model['hidden_wire']:.1f} ms "
            f"on the wire), and at most min(backward, wire) = {most:.1f} ms; it saved {saved:.1f} ms")
    print0(f"\nchecked: both variants give the full-batch gradients; the first hook was the last layer's ({first_name});")
    if args.wait_in_hook:
        print0(f"         waiting in the hook, all {len(shown.timeline)} all-reduces finished inside backward, one after the other")
    if model is None:
        print0("         with no simulated link there is no model of the wire: nothing about time is checked")
    else:
        print0(f"         in the link model's time {model['hidden']} of {len(model['rows'])} all-reduces end while "
               f"backward still runs (in the drawing above,")
        print0(f"         their = end before the |), and overlap saves {model['waiting'] - model['overlap']:.1f} ms, "
               f"at least their {model['hidden_wire']:.1f} ms on the wire")
        print0(f"         and no more than the {most:.1f} ms that could hide")


def options(parser) -> None:
    add_link_option(parser)
    parser.add_argument("--wait-in-hook", action="store_true", help="draw the no-overlap variant's timeline")


if __name__ == "__main__":
    args = parse_args(__doc__, extra=options, min_world_size=2)
    run(main, args.world_size, args, link=args.link)
