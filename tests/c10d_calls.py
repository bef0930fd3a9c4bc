"""Which collectives a piece of code launches: a dispatch mode that writes down their names."""

from torch.utils._python_dispatch import TorchDispatchMode


class RecordedCollectives(TorchDispatchMode):
    """Inside ``with RecordedCollectives() as recorded:``, ``recorded.calls`` lists every c10d
    operation launched on this thread, by name (``"allreduce_"``, ``"alltoall_base_"``, ``"send"``),
    waits left out."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "wait" not in func.__name__:
            self.calls.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
