"""One NIXL WRITE between two hosts, checked byte for byte: shipped as source, run on both ends.

Self-contained (standard library, numpy, nixl; torch only for GPU memory). The target (decode
side) registers a zeroed buffer and sends its NIXL metadata to the initiator (prefill side) over
one TCP connection to prefill's side-channel port, the way decode reaches prefill when serving
(doctor has proven that port free and reachable); the initiator WRITEs a known pattern into it
`repeat` times with a notification each time; the target compares the bytes after the last
notification. Each end prints one JSON line.

    python -c SOURCE '{"role": "target", ...}'   |   python -c SOURCE '{"role": "initiator", ...}'
"""
import base64
import importlib
import importlib.util
import json
import socket
import sys
import time

MAX_OFFER_BYTES = 4 << 20  # NIXL agent metadata is kilobytes; a peer may not make the probe read more


def nixl_api():
    flavours = [m for m in ("nixl_cu13", "nixl_cu12") if importlib.util.find_spec(m) is not None]
    if len(flavours) == 1:
        return importlib.import_module(flavours[0] + "._api")
    return importlib.import_module("nixl._api")


def pattern(nbytes, seed):
    """Bytes both ends can compute: a multiplicative hash of the word index (any numpy version)."""
    import numpy as np

    words = np.arange(nbytes // 8, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words = words * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(seed)
    return words.view(np.uint8)


def allocate(nbytes, mem, fill=None):
    """(keep-alive object, address, device id) for a buffer in DRAM or VRAM."""
    import numpy as np

    if mem == "VRAM":
        import torch

        tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        if fill is not None:
            tensor.copy_(torch.from_numpy(fill))
        return tensor, tensor.data_ptr(), tensor.device.index or 0
    array = np.zeros(nbytes, dtype=np.uint8) if fill is None else fill.copy()
    return array, array.ctypes.data, 0


def host_bytes(buffer, mem):
    return buffer.cpu().numpy() if mem == "VRAM" else buffer


def make_agent(api, name, backend):
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[backend]))
    if backend not in agent.backends:
        raise RuntimeError(f"backend {backend} could not be created (plugins: {', '.join(agent.get_plugin_list())})")
    return agent


def run_target(req):
    api = nixl_api()
    nbytes, mem, deadline = req["nbytes"], req["mem"], time.monotonic() + req["timeout"]
    agent = make_agent(api, f"kvpush-doctor-target-{req['nonce']}", req["backend"])
    buffer, addr, dev = allocate(nbytes, mem)
    agent.register_memory([(addr, nbytes, dev, "")], mem_type=mem)
    offer = {"nonce": req["nonce"], "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
             "addr": addr, "len": nbytes, "dev": dev}
    send_offer(req["addr"], req["port"], (json.dumps(offer) + "\n").encode(), deadline)
    last = f"kvpush-doctor-{req['nonce']}-{req['repeat'] - 1}".encode()
    while time.monotonic() < deadline:
        notes = [m for msgs in agent.get_new_notifs().values() for m in msgs]
        if last in notes:
            break
        time.sleep(0.001)
    else:
        return {"ok": False, "error": f"no completion notification within {req['timeout']} s"}
    import numpy as np

    got, want = host_bytes(buffer, mem), pattern(nbytes, req["seed"])
    diff = np.flatnonzero(got != want)
    return {
        "ok": diff.size == 0,
        "byte_exact": diff.size == 0,
        "nbytes": nbytes,
        "mismatched_bytes": int(diff.size),
        "first_mismatch": int(diff[0]) if diff.size else None,
        "error": None if diff.size == 0 else f"{diff.size} of {nbytes} bytes differ (first at offset {int(diff[0])})",
    }


def send_offer(addr, port, offer, deadline):
    """Dial the initiator until it listens (both ends start at about the same time) and send the offer."""
    last_error = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=2.0) as conn:
                conn.sendall(offer)
            return
        except OSError as exc:
            last_error = exc
            time.sleep(0.05)
    raise RuntimeError(f"could not send metadata to {addr}:{port}: {last_error}")


def receive_offer(bind, port, nonce, deadline):
    """The first offer from this doctor run (its nonce) on the initiator's port; others are dropped."""
    server = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with server:
        server.bind((bind, port))
        server.listen(4)
        while True:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                raise RuntimeError(f"no metadata from the target on {bind}:{port} in time") from None
            data = b""
            with conn:
                try:
                    conn.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                    while not data.endswith(b"\n") and len(data) < MAX_OFFER_BYTES:
                        chunk = conn.recv(1 << 16)
                        if not chunk:
                            break
                        data += chunk
                except OSError:
                    continue
            try:
                offer = json.loads(data)
            except ValueError:
                continue
            if isinstance(offer, dict) and offer.get("nonce") == nonce:
                return offer


def run_initiator(req):
    api = nixl_api()
    nbytes, mem, deadline = req["nbytes"], req["mem"], time.monotonic() + req["timeout"]
    agent = make_agent(api, f"kvpush-doctor-initiator-{req['nonce']}", req["backend"])
    buffer, addr, dev = allocate(nbytes, mem, fill=pattern(nbytes, req["seed"]))
    agent.register_memory([(addr, nbytes, dev, "")], mem_type=mem)
    offer = receive_offer(req["bind"], req["port"], req["nonce"], deadline)
    remote = agent.add_remote_agent(base64.b64decode(offer["metadata"]))
    local_descs = agent.get_xfer_descs([(addr, nbytes, dev)], mem)
    remote_descs = agent.get_xfer_descs([(offer["addr"], offer["len"], offer["dev"])], mem)
    handle = None
    times = []
    for i in range(req["repeat"]):
        note = f"kvpush-doctor-{req['nonce']}-{i}".encode()
        if handle is None:
            handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, remote, note)
        started = time.perf_counter()
        state = agent.transfer(handle, note)
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                return {"ok": False, "error": f"WRITE {i} still running after {req['timeout']} s"}
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            return {"ok": False, "error": f"WRITE {i} failed (NIXL state ERR)"}
        times.append(time.perf_counter() - started)
    best = min(times[1:] or times)  # the first WRITE includes connection wire-up
    return {"ok": True, "nbytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9, "first_seconds": times[0],
            "error": None}


def main(argv):
    req = json.loads(argv[1])
    try:
        report = run_target(req) if req["role"] == "target" else run_initiator(req)
    except Exception as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["role"] = req["role"]
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
