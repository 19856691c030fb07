"""CUDA graph capture: which graph serves a forward (`GraphKey`) and the capture loop.

Every graph reads and writes the runner's static buffers, so a replay only needs those
filled; graphs of one engine share one memory pool, captured largest first so smaller
graphs reuse its memory.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class GraphKey(NamedTuple):
    """One captured graph. A tuple underneath: building and hashing one per replay costs what
    the replay lookup costs anyway."""

    kind: str  # "prefill" | "decode" | "verify" | "draft" | "tree_draft" | "tree_verify"
    batch: int  # the batch bucket it was captured at (prefill graphs: 1)
    K: int = 0  # draft steps of a cycle's graphs
    tokens: int = 0  # prefill graphs: the prompt length it is padded to
    sampling: bool = False  # drafts or verifies with sampling parameters (else greedy)
    filtered: bool = False  # with top-k / top-p filtering


class Graph:
    def __init__(self, graph, outputs):
        self.graph, self.outputs = graph, outputs


def default_graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


def capture(
    jobs: list[tuple[GraphKey, Callable]], device: torch.device, graphs: dict[GraphKey, Graph], on_progress=None
):
    """Capture each (key, body) job into `graphs`, in order, all in one memory pool: a warm-up
    run of the body outside the graph (allocator, lazy init), then the capture. Returns the pool."""
    pool = None
    stream = torch.cuda.Stream(device)
    for n, (key, body) in enumerate(jobs):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            body(key.batch)  # warm-up outside the graph (allocator, lazy init)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = body(key.batch)
        if pool is None:
            pool = graph.pool()
        graphs[key] = Graph(graph, outputs)
        if on_progress:
            on_progress(n + 1, len(jobs), key, key.batch)
    torch.cuda.synchronize(device)
    return pool
