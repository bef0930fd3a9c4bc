"""The tracer's bookkeeping, without a process group."""

import threading
import time

import torch

from minddp.ddp.observers.trace import COMM_TRACK, StepTimeline, Tracer


def test_a_bar_keeps_the_step_it_was_launched_in_even_if_it_ends_later():
    tracer = Tracer(rank=0)
    fut = torch.futures.Future()
    tracer.bucket_launched(index=3, nbytes=128, when=time.perf_counter(), future=fut)
    timeline = StepTimeline(first_hook=0.0, finished=0.001)
    tracer.backward_done(timeline)  # the step moves on before the all-reduce completes
    fut.set_result(None)
    (bar,) = [e for e in tracer.events if e["tid"] == COMM_TRACK]
    assert bar["name"] == "all_reduce bucket 3" and bar["args"]["step"] == 0 and bar["args"]["bytes"] == 128
    assert tracer.step == 1


def test_clear_waits_for_completions_still_in_flight():
    tracer = Tracer(rank=0)
    fut = torch.futures.Future()
    tracer.bucket_launched(index=0, nbytes=4, when=time.perf_counter(), future=fut)
    threading.Timer(0.2, fut.set_result, args=(None,)).start()  # lands while clear() waits
    tracer.clear()
    assert tracer.events == []  # the late event was waited for, then dropped with the rest
