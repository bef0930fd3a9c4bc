"""Overlap kept under ``torch.compile``: cut the compiled graph where MiniDDP's buckets end.

[Note: why a compiled backward loses overlap]
AOT autograd turns a compiled graph's backward into *one* autograd node, which
returns every gradient at its end. MiniDDP's hooks fire after a parameter's
gradient is accumulated, so under a plain ``torch.compile`` they all fire after
that one node: the buckets leave back to back and nothing overlaps backward's
compute. torch's DDP gets overlap back with its ``DDPOptimizer``
(``torch/_dynamo/backends/distributed.py``): it cuts Dynamo's graph into
pieces of about a bucket's worth of parameters and compiles each piece on its
own, so the backward has one node per piece and a bucket can leave when its
piece is done.

:class:`BucketCut` is that idea for MiniDDP, as a ``torch.compile`` backend:

1. :func:`plan_cut` walks the graph from its end (the order backward runs
   in), counts each parameter at its *first* use in the forward (the last
   place backward adds to its gradient) and cuts when the piece holds the
   reducer's bucket cap (its first cap for the first piece), as
   ``assign_buckets`` closes a bucket.
2. ``split_module`` (torch.fx) makes one sub-graph per piece, and torch's own
   ``SubmodCompiler`` compiles each with the user's backend (inductor by
   default): it runs the pieces on fake tensors one after the other, so each
   piece is compiled for the strides the one before really produces.
3. :class:`PiecesAsBuckets`, a policy on the reducer, makes MiniDDP's buckets
   exactly the pieces at the end of a backward (never during compilation,
   so the guards Dynamo took while tracing stay true): no bucket waits for the
   next piece. torch's DDP cannot do this, since its buckets are built by its
   C++ reducer, apart from the cut, and may end a tensor off the pieces.

Where it cannot cut, the graph is compiled whole, as without this backend
(no overlap, the same gradients), and a warning says why, once per reason:
a higher-order-op region (activation checkpointing: its backward recomputes
inside one node), a piece whose outputs no later node uses (its backward
would never run), parameters of several dtypes in one graph (a bucket holds
one dtype).

How to reach it: ``minddp.compile(model)`` in place of ``torch.compile(model)``,
in either order (``minddp.compile(MiniDDP(m))`` or ``MiniDDP(minddp.compile(m))``),
or ``torch.compile(model, backend=BucketCut("inductor"))``. Each graph finds its
MiniDDP by its parameters (:func:`register_reducer`), so graph breaks are fine:
every graph is cut on its own and its pieces join the buckets in the order
their gradients arrive.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx

from minddp.ddp.core.assignment import TensorSpec, assign_buckets, size_limits
from minddp.ddp.policies import ArrivalOrder, Policy, add_policy, policies_of

__all__ = ["BucketCut", "Cut", "PiecesAsBuckets", "compile", "plan_cut", "register_reducer"]

_reducers: weakref.WeakSet = weakref.WeakSet()  # every live MiniDDP's reducer (register_reducer)


def register_reducer(reducer) -> None:
    """Let compiled graphs find ``reducer`` by its parameters (MiniDDP calls this when it builds one)."""
    _reducers.add(reducer)


def compile(model: torch.nn.Module, backend: str | Callable = "inductor", **options: Any) -> torch.nn.Module:
    """``torch.compile(model, **options)``, each graph cut at MiniDDP's buckets and compiled with ``backend``:
    a MiniDDP, or a module MiniDDP will wrap."""
    return torch.compile(model, backend=BucketCut(backend), **options)


@dataclass
class Cut:
    """Where one graph is cut: ``piece_of`` each computing node (pieces numbered in forward order), and
    ``pieces``, the reducer's parameter indices each piece's backward completes, in backward order."""

    piece_of: dict[fx.Node, int]
    pieces: list[list[int]]


def plan_cut(gm: fx.GraphModule, example_inputs: list, reducer) -> Cut | str:
    """Cut ``gm`` at ``reducer``'s bucket caps; a string saying why not where it cannot be cut."""
    # Which graph inputs are the reducer's parameters (Dynamo passes the real tensors)?
    index_of = {id(p): i for i, p in enumerate(reducer.params)}
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    param_of = {node: index_of[id(value)] for node, value in zip(placeholders, example_inputs)
                if id(value) in index_of}
    if any(isinstance(getattr(gm, str(node.target), None), fx.GraphModule)
           for node in gm.graph.nodes if node.op == "get_attr"):
        return "a higher-order-op region (activation checkpointing, say) recomputes inside one backward node"
    dtypes = {reducer.options.reduce_dtype or reducer.params[i].dtype for i in param_of.values()}
    if len(dtypes) > 1:
        return f"parameters of several dtypes ({sorted(map(str, dtypes))}) cannot share a bucket"

    computing = [node for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    # [Note: a parameter counts at its first use]
    # Backward runs the forward's nodes last to first, and a parameter's gradient is
    # complete only once the backward of every node that used it has run: the backward
    # of its *first* use in the forward. Its gradient belongs to that node's piece. A use
    # whose result carries no gradient (``w.detach()``, under ``no_grad``) sends none back.
    counted_at: dict[fx.Node, list[int]] = defaultdict(list)
    seen: set[fx.Node] = set()
    for node in computing:
        for arg in node.all_input_nodes:
            if arg in param_of and arg not in seen and _carries_gradient(node):
                seen.add(arg)
                counted_at[node].append(param_of[arg])

    limits = size_limits(*reducer.caps, reducer.per_bucket_caps)
    nbytes = [p.numel() * (reducer.options.reduce_dtype or p.dtype).itemsize for p in reducer.params]
    pieces: list[list[int]] = [[]]  # backward order: pieces[0] is the forward's last piece
    nodes_in: list[list[fx.Node]] = [[]]
    full = False
    for node in reversed(computing):
        if full and counted_at[node]:  # the piece before holds its cap: this node starts the next one
            pieces.append([])
            nodes_in.append([])
            full = False
        nodes_in[-1].append(node)
        pieces[-1].extend(counted_at[node])
        limit = limits[min(len(pieces) - 1, len(limits) - 1)]
        full = full or sum(nbytes[i] for i in pieces[-1]) >= limit
    count = len(pieces)
    piece_of = {node: count - 1 - k for k, nodes in enumerate(nodes_in) for node in nodes}  # forward numbering

    for k, nodes in enumerate(nodes_in[1:], start=1):  # every piece but the forward's last must feed a later one
        if not any(piece_of.get(user, count) > piece_of[node] for node in nodes for user in node.users):
            return f"piece {count - 1 - k} of {count} feeds no later node: its backward would never run"
    return Cut(piece_of, pieces)


def _carries_gradient(node: fx.Node) -> bool:
    """Does ``node``'s result (Dynamo's example of it, where it kept one) require a gradient?"""
    example = node.meta.get("example_value")
    if example is None:
        return True
    examples = example if isinstance(example, (tuple, list)) else [example]
    return any(isinstance(e, torch.Tensor) and e.requires_grad for e in examples)


class BucketCut:
    """A ``torch.compile`` backend: each graph cut at its MiniDDP's buckets, every piece compiled with
    ``backend`` (a name, as ``torch.compile`` takes, or a backend function)."""

    def __init__(self, backend: str | Callable = "inductor"):
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.said: set[str] = set()  # reasons already warned about
        self.cuts: list[Cut] = []  # every cut made, in compile order (for lessons and tests)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        reducer = self._reducer_of(example_inputs)
        if reducer is None:  # no MiniDDP parameter in this graph (a loss, say): nothing to cut for
            return self.backend(gm, example_inputs)
        plan = plan_cut(gm, example_inputs, reducer)
        held = frozenset(i for i, p in enumerate(reducer.params) if any(p is t for t in example_inputs))
        if isinstance(plan, str):
            self._say_once(plan)
            PiecesAsBuckets.of(reducer).record(held, None)
            return self.backend(gm, example_inputs)
        self.cuts.append(plan)
        PiecesAsBuckets.of(reducer).record(held, plan.pieces)
        if len(plan.pieces) == 1:
            return self.backend(gm, example_inputs)
        return self._compile_pieces(gm, example_inputs, plan)

    def _compile_pieces(self, gm: fx.GraphModule, example_inputs: list, plan: Cut) -> Callable:
        """One sub-graph per piece (``split_module``), each compiled with the user's backend by torch's
        ``SubmodCompiler``, the code torch's DDPOptimizer runs for the same job (see the module's note)."""
        from torch._dynamo.backends import distributed as torch_ddp_optimizer
        from torch._dynamo.utils import detect_fake_mode

        split = fx.passes.split_module.split_module(gm, None, lambda node: plan.piece_of[node])
        for copy_over in ("propagate_dynamo_source", "propagate_metadata"):  # what Dynamo knew of the inputs
            if hasattr(torch_ddp_optimizer, copy_over) and "partition_names" in split.meta:
                getattr(torch_ddp_optimizer, copy_over)(gm, split)
        fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
        with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
            torch_ddp_optimizer.SubmodCompiler(split, self.backend, fake_mode).run(*example_inputs)
        split.recompile()
        return split

    @staticmethod
    def _reducer_of(example_inputs: list):
        ids = {id(t) for t in example_inputs if isinstance(t, torch.nn.Parameter)}
        for reducer in list(_reducers):
            if any(id(p) in ids for p in reducer.params):
                return reducer
        return None

    def _say_once(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            warnings.warn(f"minddp.compile: this graph is compiled whole, without overlap: {reason}. "
                          "Its gradients are averaged after its backward, as under a plain torch.compile.",
                          stacklevel=2)


class PiecesAsBuckets(Policy):
    """Make ``reducer``'s buckets the compiled pieces, at the end of the backward after a (re)compilation.

    Each graph's pieces are kept under the set of parameters the graph holds (a recompiled graph
    replaces its older self). The buckets are the pieces, in the order their gradients arrived;
    parameters no piece holds (outside every compiled graph, or in one compiled whole) are bucketed
    by the reducer's caps where they arrived. Rank 0's buckets are broadcast, as the learned order's:
    every rank compiles at the same step, so every rank takes part in the same broadcast.
    """

    def __init__(self, reducer):
        self.reducer = reducer
        self.pieces_by_graph: dict[frozenset[int], list[list[int]] | None] = {}
        self.changed = False  # a graph was (re)compiled since the buckets were last made the pieces
        self.arrivals = ArrivalOrder()
        reducer.add_observer(self.arrivals)
        add_policy(reducer, self)

    @classmethod
    def of(cls, reducer) -> PiecesAsBuckets:
        for policy in policies_of(reducer):
            if isinstance(policy, cls):
                return policy
        return cls(reducer)

    def record(self, held: frozenset[int], pieces: list[list[int]] | None) -> None:
        """A graph holding parameters ``held`` was compiled: cut into ``pieces``, or whole (None: its
        parameters are bucketed by the caps). A recompilation that cuts as before changes nothing."""
        if held not in self.pieces_by_graph or self.pieces_by_graph[held] != pieces:
            self.pieces_by_graph[held] = pieces
            self.changed = True

    def backwards_until_final(self) -> int:
        return 1 if self.changed else 0  # a (re)compilation is followed by one rebuild, at the next backward's end

    def after_backward(self) -> None:
        if not self.changed or not self.arrivals.indices:  # (no arrivals: a joined rank's stand-in backward)
            return
        self.changed = False
        self.reducer.rebuild_groups(self._agreed(self.groups()))

    def groups(self) -> list[list[int]]:
        """The buckets this backward's arrivals and the pieces call for, in launch order."""
        reducer = self.reducer
        piece_holding = {i: piece for pieces in self.pieces_by_graph.values() if pieces
                         for piece in pieces for i in piece}
        arrived = list(dict.fromkeys(self.arrivals.indices))
        order = arrived + [i for i in reversed(range(len(reducer.params))) if i not in set(arrived)]
        groups: list[list[int]] = []
        loose: list[int] = []  # arrived outside every piece, waiting to be bucketed by caps
        for i in order:
            piece = piece_holding.get(i)
            if piece is None:
                loose.append(i)
            elif piece not in groups:
                groups += self._by_caps(loose)
                loose = []
                groups.append(piece)
        return groups + self._by_caps(loose)

    def _by_caps(self, indices: list[int]) -> list[list[int]]:
        reducer = self.reducer
        specs = [TensorSpec.of(reducer.params[i]) if reducer.options.reduce_dtype is None else
                 TensorSpec(reducer.params[i].numel(), reducer.options.reduce_dtype.itemsize,
                            reducer.options.reduce_dtype, reducer.device) for i in indices]
        return [[indices[j] for j in group] for group in assign_buckets(specs, *reducer.caps)]

    def _agreed(self, groups: list[list[int]]) -> list[list[int]]:
        """Rank 0's ``groups`` on every rank: each parameter's index and its bucket's number, broadcast."""
        reducer = self.reducer
        if reducer.world_size == 1:
            return groups
        flat = [(i, k) for k, group in enumerate(groups) for i in group]
        message = torch.tensor(flat, dtype=torch.int64, device=reducer.device)
        rank0 = dist.get_process_group_ranks(reducer.process_group)[0]
        dist.broadcast(message, src=rank0, group=reducer.process_group)
        agreed: list[list[int]] = []
        for i, k in message.tolist():
            if k == len(agreed):
                agreed.append([])
            agreed[k].append(i)
        return agreed
