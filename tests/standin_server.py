"""A light stand-in for vLLM and the router, used as a host's "python" in lifecycle tests.

`standin -m vllm.entrypoints.openai.api_server ... --host H --port P` serves /health, /metrics and
/v1/completions like a vLLM instance; `standin -m kvpush.router --config F` serves a router that
forwards completions to the first decode upstream (of its instances_file, read again on SIGHUP;
its /metrics says which list it serves, as the router's does). Any other invocation (`-` for the probe, `-m pip`,
...) runs the real interpreter, so provisioning works unchanged.
Env: STANDIN_EXIT=1 exits at once (a process that fails to start); STANDIN_READY_DELAY=S delays /health;
STANDIN_ROUTER_OUT_OF_ROTATION=N makes the router's first N /metrics pages show every instance out of
rotation (as a router that has not taken its instances back yet);
STANDIN_ENGINE_CORE=1 makes a vLLM stand-in start a child that listens on its side-channel port and
outlives it, as vLLM's `VLLM::EngineCore` outlives a SIGKILLed API server.
Keys as the real ones take them: the vLLM stand-in answers 401 on /v1 without `Bearer $VLLM_API_KEY`
when that is set; the router stand-in wants its api_key_file's key and sends instance_api_key_file's.
"""
import json
import os
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VLLM = "vllm.entrypoints.openai.api_server"
ROUTER = "kvpush.router"


def _arg(argv, flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def _key(path):
    return open(os.path.expanduser(path)).read().strip() if path else None


def serve(role, host, port, routes=None, required_key=None, upstream_key=None):
    started = time.monotonic()
    ready_after = float(os.environ.get("STANDIN_READY_DELAY", "0"))
    counters = {"external": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            sys.stdout.write("%s %s\n" % (role, fmt % args))

        def _send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                ok = time.monotonic() - started >= ready_after
                self._send(200 if ok else 503, "{}")
            elif self.path == "/metrics" and routes is not None:  # what `up` reads before its proof, after a reload
                counters["scrapes"] = counters.get("scrapes", 0) + 1
                out = counters["scrapes"] <= int(os.environ.get("STANDIN_ROUTER_OUT_OF_ROTATION", "0"))
                lines = ['kvpush_router_instance_in_rotation{instance="%s"} %s' % (n, "0.0" if out else "1.0")
                         for n in routes["names"]]
                if routes["digest"]:
                    lines.append('kvpush_router_instance_list{digest="%s"} 1.0' % routes["digest"])
                self._send(200, "\n".join(lines + [""]), "text/plain")
            elif self.path == "/metrics":
                self._send(200, "\n".join([
                    "vllm:num_requests_running{engine=\"0\"} 0.0",
                    "vllm:num_requests_waiting{engine=\"0\"} 0.0",
                    "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25",
                    "vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"external_kv_transfer\"} %d.0" % counters["external"],
                    "vllm:prompt_tokens_by_source_total{engine=\"0\",source=\"local_compute\"} 0.0", ""]), "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if required_key and self.headers.get("Authorization") != "Bearer " + required_key:
                return self._send(401, json.dumps({"error": "Unauthorized"}))
            counters["posts"] = counters.get("posts", 0) + 1
            decode_url = routes and routes["decode_url"]
            if decode_url:
                headers = {"Content-Type": "application/json"}
                if upstream_key:
                    headers["Authorization"] = "Bearer " + upstream_key
                req = urllib.request.Request(decode_url + "/v1/completions", body, headers)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return self._send(200, resp.read().decode())
            counters["external"] += len(json.loads(body).get("prompt", "").split())
            self._send(200, json.dumps({"choices": [{"text": " stand-in answer"}]}))

    ThreadingHTTPServer((host, port), Handler).serve_forever()


def engine_core(host, port):
    import socket

    listener = socket.create_server((host, port))
    while True:
        time.sleep(3600)
    listener.close()


def main(argv):
    marker = argv[:2] if argv[:1] == ["--marker"] else []
    argv = argv[len(marker):]
    if argv[:1] == ["--engine-core"]:
        engine_core(argv[1], int(argv[2]))
    if argv[:2] == ["-m", VLLM] or argv[:2] == ["-m", ROUTER]:
        if os.environ.get("STANDIN_EXIT") == "1":
            print("stand-in: exiting at once as STANDIN_EXIT=1 asks", flush=True)
            sys.exit(3)
        if argv[1] == VLLM and os.environ.get("STANDIN_ENGINE_CORE") == "1":
            import subprocess

            side = (os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            subprocess.Popen([sys.executable, __file__, *marker, "--engine-core", *side])
        if argv[1] == VLLM:
            serve("vllm", _arg(argv, "--host", "127.0.0.1"), int(_arg(argv, "--port")), required_key=os.environ.get("VLLM_API_KEY"))
        config_path = _arg(argv, "--config")
        config = json.load(open(config_path))
        routes = {"decode_url": config["decode"][0]["url"] if config.get("decode") else None, "digest": None, "names": []}
        if config.get("instances_file"):  # the instances in a file of their own, read again on SIGHUP
            import signal

            from kvpush.router.instances import load_instance_list

            def load_instances(*_):
                listed = load_instance_list(os.path.join(os.path.dirname(config_path),
                                                         os.path.expanduser(config["instances_file"])))
                routes.update(decode_url=listed.decode[0].url if listed.decode else None, digest=listed.digest(),
                              names=[u.name for u in listed.prefill + listed.decode])

            load_instances()
            signal.signal(signal.SIGHUP, load_instances)
        serve("router", config["bind"], config["port"], routes,
              required_key=_key(config.get("api_key_file")), upstream_key=_key(config.get("instance_api_key_file")))
    os.execv(sys.executable, [sys.executable] + argv)


if __name__ == "__main__":
    main(sys.argv[1:])
