"""The Slurm launcher's pure parts: topology rules, binding, rendering, parsing, error mapping."""
from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
import time

import pytest

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.slurm_allocation import acquire, refusal_line
from kvpush.deploy.lifecycle.state import DeploymentState
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.slurm_render import hold_script, sbatch_options, standalone_script
from kvpush.deploy.runners.slurm import SlurmRunner
from kvpush.deploy.runners.slurm_cli import (
    JobInfo,
    SlurmClient,
    expand_hostlist,
    job_gone_words,
    parse_job_line,
    parse_scontrol_record,
    parse_steps,
    sbatch_error_field,
    slurm_reason,
)
from kvpush.deploy.runners.slurm_step import step_shell
from kvpush.deploy.topology.slurm_topology import bind_allocation
from kvpush.deploy.topology.topology import TopologyError, parse_topology
from kvpush.templates import template_text

BASE = """
name: t
launcher: slurm
slurm: {{partition: gpu, account: acct, time_limit: "02:00:00"{slurm}}}
model: {{path: /m}}
hosts: {hosts}
prefill: [{{host: a}}]
decode: [{{host: b}}]
router: {{host: a}}
"""


def topo(hosts="{a: {node: n1}, b: {node: n2}}", slurm="", extra=""):
    return parse_topology(BASE.format(hosts=hosts, slurm=slurm) + extra)


# -- topology ------------------------------------------------------------------------------------


def test_a_slurm_host_needs_no_address_until_the_allocation_gives_one():
    t = topo(hosts="{a: {node: n1}, b: {}}")
    assert (t.hosts["a"].address, t.hosts["b"].address) == ("n1", "b")
    bound = bind_allocation(t, "7", ["n1", "n5"], {"n1": "10.0.0.1", "n5": "10.0.0.5"})
    assert [(h.node, h.address) for h in bound.hosts.values()] == [("n1", "10.0.0.1"), ("n5", "10.0.0.5")]
    assert bound.slurm.job_id == "7" and t.slurm.job_id is None  # the topology itself is unchanged


def test_binding_keeps_an_address_the_user_chose_and_refuses_nodes_outside_the_allocation():
    t = topo(hosts="{a: {node: n1, address: 192.168.5.1}, b: {node: n2}}")
    assert bind_allocation(t, "7", ["n1", "n2"], {"n1": "10.0.0.1", "n2": "10.0.0.2"}).hosts["a"].address == "192.168.5.1"
    with pytest.raises(UsageError, match=r"^hosts.b.node: node 'n2' is not in Slurm job 7's allocation \(n1,n3\)"):
        bind_allocation(t, "7", ["n1", "n3"], {})
    with pytest.raises(UsageError, match=r"^hosts: 2 hosts need a node each, but Slurm job 8 has 1 \(n1\)"):
        bind_allocation(topo(hosts="{a: {}, b: {}}"), "8", ["n1"], {})


@pytest.mark.parametrize("hosts, extra, message", [
    ("{a: {node: n1}, b: {node: n1}}", "", "hosts.b.node: node 'n1' is also host 'a'"),
    ("{a: {node: n1, user: me}, b: {node: n2}}", "", "hosts.a.user: is an SSH setting"),
])
def test_slurm_topology_mistakes_are_one_line_naming_the_field(hosts, extra, message):
    with pytest.raises(TopologyError, match=message):
        topo(hosts=hosts, extra=extra)


def test_slurm_fields_need_launcher_slurm():
    text = "model: {path: /m}\nhosts: {a: {address: 10.0.0.1, node: n1}}\nprefill: [{}]\ndecode: [{}]\n"
    with pytest.raises(TopologyError, match="hosts.a.node: names a Slurm node, which needs launcher: slurm"):
        parse_topology(text)
    with pytest.raises(TopologyError, match="slurm: applies to launcher: slurm only"):
        parse_topology(text.replace(", node: n1", "") + "slurm: {partition: p}\n")


# -- rendering -----------------------------------------------------------------------------------


def test_sbatch_options_ask_one_node_per_host_and_render_gpu_and_efa_the_slurm_way():
    assert sbatch_options(topo()) == ["--job-name=kvpush-t", "--nodes=2", "--ntasks-per-node=1", "--nodelist=n1,n2",
                                      "--partition=gpu", "--account=acct", "--time=02:00:00"]
    gpu = parse_topology(template_text("p5en-slurm"))
    options = sbatch_options(gpu)
    assert "--nodes=2" in options and not any(o.startswith("--nodelist") for o in options)  # a node count
    assert {"--exclusive", "--gpus-per-node=8", "--constraint=p5en.48xlarge"} <= set(options)
    decode = build_plan(gpu).process("decode-0")
    assert decode.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and decode.env["FI_PROVIDER"] == "efa"


def test_hold_script_only_holds_the_allocation():
    script = hold_script(topo())
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=kvpush-t\n")
    assert script.rstrip().endswith("exec sleep infinity") and not any(ln.startswith("srun") for ln in script.splitlines())


def test_each_process_is_one_srun_step_on_its_node_with_the_whole_node_shared():
    plan = build_plan(bind_allocation(topo(), "42", ["n1", "n2"], {"n1": "10.0.0.1", "n2": "10.0.0.2"}))
    line = shlex.split(plan.slurm["steps"]["decode-0"])
    assert line[:9] == ["srun", "--jobid=42", "--overlap", "--whole", "--nodes=1", "--ntasks=1", "--mpi=none",
                        "--nodelist=n2", "--job-name=decode-0"]
    assert line[9:11] == ["bash", "-c"] and "--host 10.0.0.2" in line[11]
    assert plan.host("b").slurm == {"job_id": "42", "node": "n2", "srun_options": []}


def test_step_shell_ends_what_the_process_started_when_the_process_ends(tmp_path):
    marker = f"sleep 3{abs(hash(str(tmp_path))) % 1000}.5"
    text = step_shell(["sh", "-c", f"{marker} & exit 7"], {}, str(tmp_path), str(tmp_path / "p.log"))
    assert subprocess.run(["bash", "-c", text]).returncode == 7
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout == b""  # the orphan died with it


def test_step_shell_forwards_term_and_ends_only_after_the_process_is_gone(tmp_path):
    script = tmp_path / "slow_exit.sh"
    script.write_text("trap 'sleep 0.5; echo cleaned up; exit 5' TERM; echo started; while :; do sleep 0.1; done\n")
    text = step_shell(["bash", str(script)], {}, str(tmp_path), str(tmp_path / "p.log"))
    shell = subprocess.Popen(["bash", "-c", text])
    with _group_killed_after(shell):
        log = tmp_path / "p.log"
        while "started" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.01)
        shell.terminate()
        assert shell.wait(10) == 5 and log.read_text() == "started\ncleaned up\n"


def test_step_shell_passes_sighup_on_and_the_step_goes_on(tmp_path):
    """A reload request (the router's instance list) reaches the process; it is not the step's end."""
    script = tmp_path / "reloads.sh"
    script.write_text("trap 'echo reloaded' HUP; trap 'exit 4' TERM; echo started; while :; do sleep 0.1; done\n")
    text = step_shell(["bash", str(script)], {}, str(tmp_path), str(tmp_path / "p.log"))
    # bash cannot trap a signal that was ignored when it started, as it is when the tests run under nohup
    shell = subprocess.Popen(["bash", "-c", text], preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    with _group_killed_after(shell):
        log = tmp_path / "p.log"
        while "started" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.01)
        shell.send_signal(signal.SIGHUP)
        while "reloaded" not in log.read_text():
            assert shell.poll() is None
            time.sleep(0.01)
        assert shell.poll() is None
        shell.terminate()
        assert shell.wait(10) == 4 and log.read_text() == "started\nreloaded\n"


@contextlib.contextmanager
def _group_killed_after(shell: subprocess.Popen):
    """Whatever the test's outcome, neither the step shell nor what it started (in a session of its
    own, but still its child) outlives the test."""
    import psutil

    try:
        yield
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(shell.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        shell.kill()
        shell.wait(10)


def test_step_shell_runs_the_process_with_its_log_and_home_relative_paths(tmp_path):
    text = step_shell(["sh", "-c", "echo $0 $KV; echo err >&2", "~/x"], {"KV": "a b,c"}, str(tmp_path / "w"), "~/logs/p.log")
    assert text.startswith(f"mkdir -p {tmp_path / 'w'} \"$HOME\"/logs && cd {tmp_path / 'w'}")
    home = tmp_path / "home"
    home.mkdir()
    (home / "logs").mkdir()
    (home / "logs" / "p.log").write_text("old\n")
    subprocess.run(["bash", "-c", text], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    assert (home / "logs" / "p.log").read_text() == f"{home}/x a b,c\nerr\n"
    assert (home / "logs" / "p.log.1").read_text() == "old\n"


def test_standalone_script_writes_files_launches_every_step_and_ends_with_the_first_one():
    t = parse_topology(template_text("slurm-cpu"))
    plan = build_plan(t)
    script = standalone_script(t, plan.hosts, "x.yaml")
    lines = script.splitlines()
    assert "#SBATCH --nodelist=n1,n2" in lines and "#SBATCH --output=kvpush-slurm-cpu-%j.out" in lines
    steps = [ln for ln in lines if ln.endswith(" &")]
    assert [shlex.split(s)[7] for s in steps] == ["--job-name=prefill-0", "--job-name=decode-0", "--job-name=router"]
    assert not any("--jobid" in s for s in steps)
    router_json = lines[lines.index(next(ln for ln in lines if "--job-name=write-file" in ln)) + 1]
    assert router_json.startswith("{") and lines[-3:] == ["wait -n", lines[-2], "exit 1"]
    with pytest.raises(UsageError, match=r"^hosts.prefill-node.node: a standalone script needs every host to name"):
        standalone_script(parse_topology(template_text("p5en-slurm")), [], "x")


def _slurm_cpu_with(extra: str):
    text = template_text("slurm-cpu").replace("router:\n  host: n2\n", f"router:\n  host: n2\n{extra}")
    t = parse_topology(text)
    return t, build_plan(t)


def test_the_standalone_script_holds_no_secret_and_makes_its_own_on_the_job_s_node(monkeypatch):
    monkeypatch.setenv("CLIENT_KEY_VAR", "the-client-key-value")
    t, plan = _slurm_cpu_with("  api_key_env: CLIENT_KEY_VAR\n")
    script = standalone_script(t, plan.hosts, "x.yaml")
    lines = script.splitlines()
    assert "the-client-key-value" not in script and "kvpush-secret-v1" not in script
    index = lines.index
    umask, private = index("kvpush_umask=$(umask); umask 077"), index('kvpush_private=$(mktemp -d) || exit 1')
    assert umask < private and "trap 'rm -rf \"$kvpush_private\"' EXIT" in lines
    derive = [ln for ln in lines if "-m kvpush.deploy.lifecycle.secret_content" in ln]
    assert derive[0] == '"$kvpush_python" -m kvpush.deploy.lifecycle.secret_content new >"$kvpush_private/secret" || exit 1'
    assert derive[1].startswith('"$kvpush_python" -m kvpush.deploy.lifecycle.secret_content router-client-key '
                                '--secret "$kvpush_private/secret" --client-key-env CLIENT_KEY_VAR >')  # a missing key fails first
    writes = [ln for ln in lines if "--job-name=write-secret" in ln]
    assert len(writes) == sum(len(h.secret_files) for h in plan.hosts) == 7  # router-params.key too
    assert all(w.endswith('<"$kvpush_private/' + w.split('<"$kvpush_private/')[-1]) for w in writes)  # content on stdin
    assert all("umask 077 && " in w for w in writes)
    cleanup = index('rm -rf "$kvpush_private"')
    first_process = next(i for i, ln in enumerate(lines) if ln.endswith(" &"))
    assert max(index(w) for w in writes) < cleanup < first_process and lines[cleanup + 1] == 'umask "$kvpush_umask"'


def test_the_standalone_script_reads_the_client_key_file_at_job_time_and_skips_it_without_one():
    t, plan = _slurm_cpu_with("  api_key_file: ~/router.key\n")
    assert "--client-key-file '~/router.key'" in standalone_script(t, plan.hosts, "x.yaml")
    t = parse_topology(template_text("slurm-cpu"))
    script = standalone_script(t, build_plan(t).hosts, "x.yaml")
    assert "router-client-key" not in script and "--client-key" not in script


def _run_script_here(script: str, tmp_path, extra_env: dict[str, str] | None = None):
    """The script's own shell run for real, with an srun that runs write steps here and nothing else
    (the real Slurm run is tests/integration/test_lifecycle_slurm.py); its result and environment."""
    bin_dir, home, tmp = tmp_path / "bin", tmp_path / "home", tmp_path / "tmp"
    for d in (bin_dir, home, tmp):
        d.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nname=""\nwhile [ "$1" != bash ]; do case "$1" in --job-name=*) name=${1#--job-name=};; esac; shift; done\n'
                    'case "$name" in write-*) exec "$@";; *) exit 0;; esac\n')
    srun.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp), "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "7",
           **(extra_env or {})}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120), env


def _secret_paths(plan, home) -> dict[str, str]:
    import os

    return {f.kind: os.path.expanduser(f.path).replace(os.path.expanduser("~"), str(home), 1)
            for h in plan.hosts for f in h.secret_files}


def test_the_standalone_script_s_secret_part_writes_private_derived_files_and_removes_its_copies(tmp_path):
    import os

    from kvpush.common import deployment_secret as ds

    t = parse_topology(template_text("slurm-cpu"))
    plan = build_plan(t)
    script = standalone_script(t, plan.hosts, "x.yaml")
    ran, env = _run_script_here(script, tmp_path)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    assert ran.returncode == 1 and "a step ended" in ran.stderr, ran.stderr  # the stand-in steps end at once
    paths = _secret_paths(plan, home)
    for path in paths.values():
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    secret = ds.read_secret(paths["deployment-secret"])
    assert open(paths["instance-env"]).read() == f"VLLM_API_KEY={ds.derive_token(secret, ds.INSTANCE_API_KEY)}\n"
    assert list(tmp.iterdir()) == []
    refused = subprocess.run(["bash", "-c", script], env={**env, "SLURMD_NODENAME": "login"}, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "kvpush: the batch script runs on node login, none of this deployment's (n1, n2)"]


def test_the_standalone_script_reads_the_topologys_secrets_in_the_job_and_holds_none(tmp_path):
    from kvpush.common import deployment_secret as ds

    value_file = tmp_path / "db.pass"
    value_file.write_text("db 'value' $(from) a file\n")
    value_file.chmod(0o600)
    text = template_text("slurm-cpu") + f"secrets:\n  HF_TOKEN: {{env: SUBMITTER_HF}}\n  DB_PASSWORD: {{file: {value_file}}}\n"
    t = parse_topology(text)
    plan = build_plan(t)
    script = standalone_script(t, plan.hosts, "x.yaml")
    assert "hf value" not in script and "from) a file" not in script and "<redacted>" not in script
    ran, env = _run_script_here(script, tmp_path, {"SUBMITTER_HF": "hf value; `from` the submitter"})
    assert ran.returncode == 1 and "a step ended" in ran.stderr, ran.stderr
    instance_env = _secret_paths(plan, tmp_path / "home")["instance-env"]
    sourced = subprocess.run(["sh", "-c", f'set -a; . "{instance_env}"; printf "%s|%s|%s" "$VLLM_API_KEY" "$HF_TOKEN" "$DB_PASSWORD"'],
                             env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True).stdout
    secret = ds.read_secret(_secret_paths(plan, tmp_path / "home")["deployment-secret"])
    assert sourced == f"{ds.derive_token(secret, ds.INSTANCE_API_KEY)}|hf value; `from` the submitter|db 'value' $(from) a file"
    (tmp_path / "again").mkdir()
    unset = _run_script_here(script, tmp_path / "again")[0]
    assert unset.returncode == 1 and "secrets.HF_TOKEN: SUBMITTER_HF is unset or empty in the job's environment" in unset.stderr


# -- parsing Slurm's output ----------------------------------------------------------------------


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("gpu-[08-10],login1", ["gpu-08", "gpu-09", "gpu-10", "login1"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("", []),
])
def test_hostlist_expansion(text, names):
    assert expand_hostlist(text) == names


def test_steps_and_jobs_parse_from_squeue():
    steps = parse_steps("4", "4.0|prefill-0|n1|2026-12-01T18:18:35\n4.batch|batch|n1|2026-12-01T18:18:35\n"
                             "4.extern|extern|n1|N/A\n4.12|router|n2|2026-12-01T18:19:01\n")
    assert [(s.step_id, s.name, s.node) for s in steps] == [(0, "prefill-0", "n1"), (12, "router", "n2")]
    assert steps[1].start_time - steps[0].start_time == 26
    assert parse_job_line("4", "RUNNING|None|n[1-2]\n") == JobInfo("4", "RUNNING", "None", ["n1", "n2"])
    assert parse_job_line("4", "") is None
    assert parse_scontrol_record("JobId=2 JobName=hold\n   JobState=CANCELLED Reason=None")["JobState"] == "CANCELLED"


@pytest.mark.parametrize("stderr, field", [
    ("sbatch: error: invalid partition specified: nope\nsbatch: error: Batch job submission failed: Invalid partition name specified",
     "slurm.partition"),
    ("allocation failure: Requested node configuration is not available", "hosts"),
    ("allocation failure: Invalid node name specified", "hosts.*.node"),
    ("sbatch: error: Invalid generic resource (gres) specification", "slurm.gpus_per_node"),
    ("sbatch: unrecognized option '--bogus'\nTry \"sbatch --help\" for more information", "slurm.sbatch_options"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified", "slurm.account"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)", "slurm.time_limit"),
    ("something else entirely", None),
])
def test_sbatch_refusals_map_to_the_field_they_are_about(stderr, field):
    assert sbatch_error_field(stderr) == field


def test_slurm_reason_is_one_line_of_slurms_own_words():
    assert slurm_reason("sbatch: error: invalid partition specified: nope\n"
                        "sbatch: error: Batch job submission failed: Invalid partition name specified") == \
        "invalid partition specified: nope; Batch job submission failed: Invalid partition name specified"
    assert slurm_reason("sbatch: unrecognized option '--x'\nTry \"sbatch --help\" for more information") == "unrecognized option '--x'"


def test_job_gone_words():
    assert job_gone_words("5", None) == "Slurm job 5 has ended (Slurm no longer knows it)"
    assert job_gone_words("5", JobInfo("5", "CANCELLED", "None", [])) == "Slurm job 5 has ended (CANCELLED)"
    assert job_gone_words("5", JobInfo("5", "PENDING", "Priority", [])) == "Slurm job 5 is PENDING (Priority)"


# -- allocation logic with a recorded Slurm ------------------------------------------------------


class FakeSlurm:
    """Answers Slurm's commands from a table; records every call."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]):
        self.answers, self.calls = answers, []

    def __call__(self, argv, stdin, timeout):
        self.calls.append(argv)
        code, out, err = next((v for k, v in self.answers.items() if " ".join(argv).startswith(k)), (0, "", ""))
        return subprocess.CompletedProcess(argv, code, out.encode(), err.encode())


def test_refusals_name_the_field_and_the_partition_size():
    fake = FakeSlurm({"sinfo": (0, "2|gpu\n", "")})
    line = refusal_line(topo(), "allocation failure: Requested node configuration is not available", SlurmClient(fake))
    assert line.startswith("hosts: the deployment needs 2 nodes (one per host); partition gpu has 2; Slurm: allocation failure")


def test_a_refused_submission_queues_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    fake = FakeSlurm({"sbatch --test-only": (1, "", "sbatch: error: invalid partition specified: gpu")})
    with pytest.raises(UsageError, match="^slurm.partition: Slurm refused partition 'gpu': invalid partition specified: gpu"):
        acquire(topo(), DeploymentState("t"), None, SlurmClient(fake))
    assert [c[:2] for c in fake.calls] == [["sbatch", "--test-only"]]


def test_an_allocation_that_is_not_running_is_refused_as_input(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    fake = FakeSlurm({"squeue -h -j 77": (0, "", ""), "scontrol show job 77": (1, "", "slurm_load_jobs error: Invalid job id specified")})
    with pytest.raises(UsageError, match=r"^SLURM_JOB_ID: Slurm job 77 has ended \(Slurm no longer knows it\), not running"):
        acquire(topo(), DeploymentState("t"), None, SlurmClient(fake))


# -- the runner over a recorded Slurm ------------------------------------------------------------


def test_runner_sees_steps_as_processes_and_signals_them_with_scancel():
    fake = FakeSlurm({"squeue -h -s -j 9": (0, "9.3|prefill-0|n1|2026-12-01T18:18:35\n9.4|decode-0|n2|2026-12-01T18:18:36\n", "")})
    runner = SlurmRunner("a", "10.0.0.1", "9", "n1", client=SlurmClient(fake))
    infos = runner.inspect([3, 4])
    assert (infos[3].state, infos[3].pgid, infos[4].state) == ("alive", 3, "dead")  # step 4 runs on another node
    assert runner.group_members([3, 4]) == {3: [infos[3]], 4: []}  # listpids said nothing: the step stands for itself
    runner.signal_groups([3], "TERM")
    assert fake.calls[-1] == ["scancel", "--signal=TERM", "9.3"]


def test_runner_reaches_the_nodes_loopback_at_the_nodes_address():
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        runner = SlurmRunner("a", "127.0.0.1", "9", "n1", client=SlurmClient(FakeSlurm({})))
        assert runner.http("GET", f"http://localhost:{server.server_address[1]}/").status == 200
    finally:
        server.shutdown()


def test_listpids_parses_each_process_of_a_numbered_step():
    from kvpush.deploy.runners.slurm import parse_listpids

    text = ("PID      JOBID    STEPID   LOCALID GLOBALID\n10445    4        2        0       0\n"
            "10446    4        2        -       -\n10175    4        batch    0       0\n")
    assert parse_listpids(text) == [(10445, 2), (10446, 2)]


def test_the_runner_writes_through_an_unguessable_exclusive_temporary_file(tmp_path):
    """Its command run by a real shell here, as srun would on the node: a link planted at the old
    predictable name ({target}.{pid}.tmp) is never followed, and nothing is left beside the target."""
    import os

    from kvpush.deploy.runners.local import LocalRunner

    class HereRunner(SlurmRunner):
        def run(self, command, timeout=None, stdin=None):
            self.commands.append(command)
            return LocalRunner("here").run(command, timeout, stdin)

    runner = HereRunner("a", "10.0.0.1", "9", "n1", client=SlurmClient(FakeSlurm({})))
    runner.commands = []
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "dir" / "router.json"
    target.parent.mkdir()
    os.symlink(victim, f"{target}.{os.getpid()}.tmp")
    runner.write_file(str(target), b"content", mode=0o640)
    assert target.read_bytes() == b"content" and (target.stat().st_mode & 0o777) == 0o640
    assert victim.read_text() == "untouched"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["router.json", f"router.json.{os.getpid()}.tmp"])
    assert "mktemp" in runner.commands[-1] and f".{os.getpid()}.tmp" not in runner.commands[-1]
