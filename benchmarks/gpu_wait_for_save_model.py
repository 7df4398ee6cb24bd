"""gpu_wait_for_save.py's stand-in model: the workloads, the requests they push, and the
forward-sized work each step launches on the compute stream."""
from __future__ import annotations

from dataclasses import dataclass

from gpu_transfer import kvl, torch


@dataclass(frozen=True)
class Workload:
    name: str
    tokens: int  # per step, the matmuls' M
    request_tokens: int  # of each pushed request
    push_every: int  # steps per request: its KV is written in that many chunks, pushed after the last
    warmup_steps: int
    timed_steps: int
    graph: bool  # replay the forward from a CUDA graph (vLLM does for decode batches)

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.timed_steps


GPU_WORKLOADS = {
    "prefill": Workload("prefill", 16384, 16384, 1, 2, 12, False),
    "decode": Workload("decode", 128, 1024, 8, 32, 320, True),
    # the prefill again, launched as one CUDA graph: the compute thread is not held up by a full
    # launch queue, whatever it launches
    "prefill-graph": Workload("prefill-graph", 16384, 16384, 1, 2, 12, True),
}
CPU_WORKLOADS = {
    "prefill": Workload("prefill", 64, 64, 1, 1, 4, False),
    "decode": Workload("decode", 8, 32, 2, 2, 8, False),
}


def workloads(names: list[str], on_gpu: bool, steps: int | None) -> list[Workload]:
    """The named workloads; `steps` (timed steps per run) rounded up to whole requests."""
    table = GPU_WORKLOADS if on_gpu else CPU_WORKLOADS
    unknown = [name for name in names if name not in table]
    if unknown:
        raise SystemExit(f"workloads {unknown} need a GPU; on CPU: {', '.join(table)}")
    chosen = [table[name] for name in names]
    if steps:
        chosen = [Workload(w.name, w.tokens, w.request_tokens, w.push_every, w.warmup_steps,
                           -(-steps // w.push_every) * w.push_every, w.graph) for w in chosen]
    return chosen


def requests_of(workload: Workload, block_size: int, num_blocks: int) -> list[tuple[list[int], list[int], int]]:
    """(source blocks at P, destination blocks at D, the step that finishes it) per request: P's
    in allocation order, D's from the other end of its cache."""
    n = -(-workload.request_tokens // block_size)
    out = []
    for r in range(workload.steps // workload.push_every):
        src = list(range(r * n, (r + 1) * n))
        dst = list(range(num_blocks - (r + 1) * n, num_blocks - r * n))
        out.append((src, dst, (r + 1) * workload.push_every - 1))
    return out


def blocks_needed(chosen: list[Workload], block_size: int) -> int:
    """Blocks per side for the largest workload: every request has blocks of its own."""
    return max(len(requests_of(w, block_size, 1 << 40)) * -(-w.request_tokens // block_size) for w in chosen)


def plan_of(workload: Workload, requests, device: str) -> torch.Tensor:
    """The blocks each step writes: its chunk of the request being prefilled."""
    rows = []
    for src, _, _ in requests:
        chunk = len(src) // workload.push_every
        rows += [src[i * chunk:(i + 1) * chunk] for i in range(workload.push_every)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


class StandInModel:
    """Per layer x @ Wqkv, attention output @ Wo, @ Wgate_up, @ Wdown (bf16, one weight set per
    layer so a step streams all of them from memory like a real shard), then the KV of the step's
    chunk written into that layer's blocks: kvl.pattern of (layer, block), so the receiver can
    check it. Attention itself is left out: it has no weights and the connector never sees it."""

    def __init__(self, args, workload: Workload, cache: kvl.KVCache, plan: torch.Tensor):
        dev, dt = args.device, torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)

        def weight(rows, cols):
            return torch.randn(rows, cols, device=dev, dtype=dt, generator=gen) / rows ** 0.5

        self.layers = [(weight(args.hidden, args.qkv), weight(args.attn_out, args.hidden),
                        weight(args.hidden, 2 * args.mlp), weight(args.mlp, args.hidden)) for _ in range(args.layers)]
        self.attn_out, self.mlp = args.attn_out, args.mlp
        self.x = torch.randn(workload.tokens, args.hidden, device=dev, dtype=dt, generator=gen)
        self.views = [cache.block_major(layer) for layer in range(args.layers)]
        self.block_shape = tuple(self.views[0].shape[1:])
        # pattern(layer) = pattern(0) + layer * 1_000_003 in 16-bit arithmetic (kvl.pattern)
        self.offsets = [((layer * 1_000_003) & 0xFFFF) - (65536 if (layer * 1_000_003) & 0x8000 else 0)
                        for layer in range(args.layers)]
        self.plan = plan  # [steps, blocks per step] on the device: the blocks each step writes
        self.blocks = plan[0].clone()  # the graph's input
        self.graph = None
        if workload.graph:
            try:
                self._capture()
            except RuntimeError as exc:  # report it and measure the workload launched kernel by kernel
                print(f"  CUDA graph capture failed, {workload.name} runs eagerly: {exc}", flush=True)
                self.graph = None

    def _forward(self, blocks: torch.Tensor) -> None:
        kv0 = kvl.pattern(0, blocks, self.block_shape)
        x = self.x
        for (w_qkv, w_o, w_gu, w_down), view, offset in zip(self.layers, self.views, self.offsets):
            qkv = x @ w_qkv
            h = x + qkv[:, :self.attn_out] @ w_o
            x = (h @ w_gu)[:, :self.mlp] @ w_down
            view.index_copy_(0, blocks, kv0 + offset)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(self.blocks)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward(self.blocks)

    def launch(self, step: int) -> None:
        if self.graph is None:
            self._forward(self.plan[step])
        else:
            self.blocks.copy_(self.plan[step])
            self.graph.replay()
