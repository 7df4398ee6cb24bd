"""Does UCX move GPU memory between two processes over CUDA IPC or through its TCP emulation,
depending on the thread that loads the peer's NIXL metadata?

One GPU, two processes (writer: this one; receiver: a child), each with a VRAM buffer registered
with its own NIXL agent (UCX). For each variant the writer makes a fresh agent, loads the
receiver's metadata (`add_remote_agent`) on the thread the variant names, and moves `--mib` MiB
in `--descs` descriptors, WRITE and READ, timed from post to DONE; the receiver checks every byte.

  main          add_remote_agent on the main thread (it has allocated tensors: a CUDA context)
  thread        on a fresh Python thread that made no CUDA call (no current CUDA context)
  thread-bound  on a fresh thread after kvpush.connector.cuda_context.bind_device_context
  engine        kvpush's NixlEngine.add_peer on a fresh thread (binds the context itself)

Run with UCX_PROTO_INFO=y to see UCX's protocol choice for each variant's first transfer.
  python3 benchmarks/gpu_nixl_context.py --json nixl_context.json
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import gpu_bench_common as common
from gpu_bench_common import np, torch
from kvpush.connector import cuda_context, transfer as transfer_mod
from kvpush.connector.regions import Region

VARIANTS = ("main", "thread", "thread-bound", "engine")


def receiver_main(conn, nbytes: int, device: str) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    mem = common.mem_type(device)
    agent = nixl_agent(f"ctx-recv-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], mem)
    common.sync(device)

    def meta():
        return ("meta", agent.get_agent_metadata(), buf.data_ptr())

    def fill(seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g))
        common.sync(device)
        return ("ok",)

    def poison():
        buf.fill_(0xA5)
        common.sync(device)
        return ("ok",)

    def digest():
        common.sync(device)
        return ("digest", int(buf.to(torch.int64).sum().item()), int(buf[::4097].to(torch.int64).sum().item()))

    def cleanup():
        agent.deregister_memory(reg)

    common.serve(conn, {"meta": meta, "fill": fill, "poison": poison, "digest": digest}, cleanup)


def on_thread(fn, fresh: bool):
    if not fresh:
        return fn()
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), name="kvpush-ctx-probe")
    t.start()
    t.join()
    return out[0]


def has_context() -> bool | None:
    try:
        return cuda_context.current_context() is not None
    except (OSError, cuda_context.CudaContextError):
        return None  # no CUDA driver (a CPU smoke run)


def run_variant(variant: str, receiver: common.ChildProcess, src: torch.Tensor, nbytes: int, descs: int,
                repeats: int, device: str) -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    mem = common.mem_type(device)
    _, peer_meta, dst_base = receiver.call("meta")
    piece = nbytes // descs
    rows_local = np.array([[src.data_ptr() + i * piece, piece, 0] for i in range(descs)], dtype=np.int64)
    rows_remote = np.array([[dst_base + i * piece, piece, 0] for i in range(descs)], dtype=np.int64)
    result: dict = {"variant": variant}
    thread_ctx: list = []
    print(f"=== variant {variant} ===", flush=True)
    if variant == "engine":
        region = Region(base=src.data_ptr(), block_len=piece, stride=piece, num_blocks=descs)
        engine = transfer_mod.NixlEngine(f"ctx-engine-{os.getpid()}", [region], mem_type=mem, device_id=0)
        peer_region = Region(base=dst_base, block_len=piece, stride=piece, num_blocks=descs)

        def add():
            peer = engine.add_peer(peer_meta, [peer_region], 0)
            thread_ctx.append(has_context())
            return peer

        peer = on_thread(add, fresh=True)
        agent, agent_name = engine._agent, peer.agent_name
    else:
        agent = nixl_agent(f"ctx-{variant}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(src.data_ptr(), nbytes, 0, "")], mem)

        def add():
            if variant == "thread-bound":
                cuda_context.bind_device_context(0)
            thread_ctx.append(has_context())
            name = agent.add_remote_agent(peer_meta)
            agent.make_connection(name)
            return name

        agent_name = on_thread(add, fresh=variant != "main")
    result["context_on_loading_thread"] = thread_ctx[0]
    for op in ("WRITE", "READ"):
        times, exact = [], True
        for r in range(repeats + 1):
            if op == "WRITE":
                receiver.call("poison")
            else:
                receiver.call("fill", r)
                src.fill_(0x5A)
                common.sync(device)
            local = agent.get_xfer_descs(rows_local, mem)
            remote = agent.get_xfer_descs(rows_remote, mem)
            t0 = time.perf_counter()
            handle = agent.initialize_xfer(op, local, remote, agent_name)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - t0
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"{variant} {op} ended in {state}")
            common.sync(device)
            _, total, sample = receiver.call("digest")
            mine = (int(src.to(torch.int64).sum().item()), int(src[::4097].to(torch.int64).sum().item()))
            exact &= (total, sample) == mine
            if r:  # the first one wires up
                times.append(seconds)
        med = float(np.median(times))
        result[op] = {"median_s": med, "gb_per_s": nbytes / med / 1e9, "byte_exact": exact,
                      "times_s": times}
        print(f"{variant:13s} {op:5s} {nbytes / 2**20:.0f} MiB in {descs} descriptors: {med * 1e3:8.2f} ms "
              f"{nbytes / med / 1e9:8.2f} GB/s exact={exact} (context on loading thread: {thread_ctx[0]})", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--descs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    ap.add_argument("--json")
    args = ap.parse_args()
    nbytes = args.mib * 2**20
    device = args.device
    common.describe_environment(device)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = common.copy_seconds(device, src, dst, nbytes)
    del dst
    print(f"device copy of {args.mib} MiB: {copy_s * 1e3:.2f} ms, {nbytes / copy_s / 1e9:.1f} GB/s", flush=True)
    receiver = common.ChildProcess("receiver", receiver_main, nbytes, device)
    results = {"device_copy_gb_per_s": nbytes / copy_s / 1e9, "mib": args.mib, "descs": args.descs,
               "ucx_tls": os.environ.get("UCX_TLS", "(default)"), "variants": []}
    try:
        for variant in args.variants.split(","):
            try:
                results["variants"].append(run_variant(variant, receiver, src, nbytes, args.descs, args.repeats, device))
            except Exception as exc:  # one variant's failure is a result too
                print(f"{variant}: FAILED: {exc}", flush=True)
                results["variants"].append({"variant": variant, "error": str(exc)})
    finally:
        receiver.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
