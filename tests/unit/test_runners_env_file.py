"""kvpush.deploy.runners.env_file: an instance's env file is sourced only when it is this user's,
private, and in directories no one else can swap it in. Run by real shells."""
from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from kvpush.deploy.runners.base import detached_start_command, shell_word
from kvpush.deploy.runners.env_file import checked_source_command
from kvpush.deploy.runners.slurm_step import step_shell


@pytest.fixture
def layout(tmp_path):
    workdir = tmp_path / "workdir"
    deployment = workdir / "dep"
    deployment.mkdir(parents=True)
    workdir.chmod(0o755)
    deployment.chmod(0o700)
    env_file = deployment / "instance-api-key.env"
    env_file.write_text("VLLM_API_KEY=the-key\nHF_TOKEN='a b'\n")
    env_file.chmod(0o600)
    return workdir, deployment, env_file


def _source(env_file, shell="sh", quote=shlex.quote, env=None):
    command = checked_source_command(str(env_file), quote) + 'printf "%s|%s|%s" "$VLLM_API_KEY" "$HF_TOKEN" "$#"'
    return subprocess.run([shell, "-c", command], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("shell", ["sh", "bash", "dash"])
def test_a_private_file_in_private_directories_is_sourced(layout, shell):
    ran = _source(layout[2], shell)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "the-key|a b|0", "")


@pytest.mark.parametrize("change,names,says", [
    (lambda w, d, f: f.chmod(0o640), "f", "is owned by uid {uid} with mode 640, not this user's private file (0600)"),
    (lambda w, d, f: f.chmod(0o604), "f", "with mode 604"),
    (lambda w, d, f: os.chown(f, 4321, -1), "f", "is owned by uid 4321 with mode 600"),
    (lambda w, d, f: (f.unlink(), f.symlink_to("/etc/hostname")), "f", "not a regular file (missing, or a link)"),
    (lambda w, d, f: f.unlink(), "f", "not a regular file (missing, or a link); rerun kvpush up, which writes it"),
    (lambda w, d, f: d.chmod(0o707), "d", "the deployment's directory is owned by uid {uid} with mode 707"),
    (lambda w, d, f: (os.chown(d, -1, 4321), d.chmod(0o770)), "d", "with mode 770: it must be this user's"),
    (lambda w, d, f: os.chown(d, 4321, -1), "d", "the deployment's directory is owned by uid 4321"),
    (lambda w, d, f: w.chmod(0o777), "w", "the workdir is owned by uid {uid} with mode 777: others could replace"),
    (lambda w, d, f: os.chown(w, 4321, -1), "w", "the workdir is owned by uid 4321 with mode 755"),
])
def test_anything_else_stops_the_launch_with_one_line_naming_the_path(layout, change, names, says):
    if os.geteuid() != 0 and "chown" in repr(change.__code__.co_names):
        pytest.skip("changing an owner needs root")
    workdir, deployment, env_file = layout
    change(workdir, deployment, env_file)
    ran = _source(env_file)
    path = {"f": env_file, "d": deployment, "w": workdir}[names]
    assert ran.returncode == 1 and ran.stdout == ""
    assert ran.stderr.splitlines() == [ran.stderr.strip()] and ran.stderr.startswith(f"kvpush: {path}: ")
    assert says.format(uid=os.geteuid()) in ran.stderr


@pytest.mark.parametrize("change", [lambda w, d: w.chmod(0o1777), lambda w, d: d.chmod(0o750),
                                    lambda w, d: (os.chown(d, -1, os.getegid()), d.chmod(0o770))])
def test_sticky_workdirs_and_this_user_s_own_group_pass(layout, change):
    workdir, deployment, env_file = layout
    change(workdir, deployment)
    assert _source(env_file).returncode == 0


def test_a_home_relative_path_is_checked_where_the_shell_runs(layout):
    workdir, _, env_file = layout
    home = workdir.parent
    ran = _source("~/" + str(env_file.relative_to(home)), quote=shell_word, env={"HOME": str(home), "PATH": os.environ["PATH"]})
    assert ran.returncode == 0 and ran.stdout.startswith("the-key|")


def test_both_launchers_check_before_they_source(layout, tmp_path):
    _, deployment, env_file = layout
    for text in (detached_start_command(["/py"], {}, str(deployment), str(deployment / "p.log"), str(env_file)),
                 step_shell(["/py"], {}, str(deployment), str(deployment / "p.log"), str(env_file))):
        assert text.index("kvpush_open()") < text.index(f". {env_file} ||")
    env_file.chmod(0o644)
    log = deployment / "logs" / "p.log"
    step = step_shell(["sh", "-c", "echo started"], {}, str(deployment), str(log), str(env_file))
    ran = subprocess.run(["bash", "-c", step], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and "started" not in log.read_text()
    assert log.read_text().startswith(f"kvpush: {env_file}: is owned by uid")  # where `up` shows a failed start
