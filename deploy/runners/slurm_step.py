"""One Slurm job step as shell text: the srun line up to the command, and the step's command.

Pure; the Slurm runner launches exactly this, and `kvpush plan` shows it.
"""
from __future__ import annotations

from .base import shell_word
from .env_file import checked_source_command

# Every step shares the whole allocation of its node with the others (--overlap --whole): a step
# of one task would otherwise get one CPU and no GPU, and two steps on a node would queue.
STEP_OPTIONS = ("--overlap", "--whole", "--nodes=1", "--ntasks=1", "--mpi=none")
GROUP_EXIT_WAIT_TENTHS = 100  # a killed process group gets 10 s to be gone (large processes take a moment)


def step_shell(argv: list[str], env: dict[str, str], cwd: str, log_path: str, env_file: str | None = None) -> str:
    """The step's command: log to the node's file (the previous one kept as .1), run argv in a
    process group of its own, and when argv's process ends, end everything it started and wait
    until it is gone; only then does the step end.

    Slurm signals a cancelled step's processes, but where it tracks them by parentage
    (proctrack/linuxproc) a process orphaned by its parent's death (vLLM's engine core) escapes
    it: the group kill is what makes the process tree die with its top. Forwarding TERM and
    waiting keeps the step listed until its processes have really exited, ports closed. SIGHUP (a
    reload request, e.g. the router's) is passed on, never the end of the step. The traps are in
    place before argv starts, so a signal that comes as it starts cannot end the shell alone and
    leave argv running: a TERM that comes before argv's pid is known is passed on once it is; a HUP
    then is dropped (argv is only starting, and reads its configuration anyway). With env_file,
    its variables (secrets) are exported by the step's shell, never written on a command line,
    once the file passed env_file.py's check."""
    log_dir = log_path.rsplit("/", 1)[0] if "/" in log_path else "."
    log = shell_word(log_path)
    env_words = " ".join(f"{k}={shell_word(v)}" for k, v in sorted(env.items()))
    # A failed check of the env file is one line in the process's log, where `up` looks.
    source = f"{{ {checked_source_command(env_file, shell_word)}}} 2>>{log}; " if env_file else ""
    return (
        f"mkdir -p {shell_word(cwd)} {shell_word(log_dir)} && cd {shell_word(cwd)} || exit 1; "
        f"if [ -f {log} ]; then mv -f {log} {log}.1; fi; {source}"
        "pid=; term_before_start=; "
        "trap 'if [ -n \"$pid\" ]; then kill -TERM $pid 2>/dev/null; else term_before_start=1; fi' TERM INT; "
        "trap '[ -z \"$pid\" ] || kill -HUP $pid 2>/dev/null' HUP; "
        f"setsid env {env_words} {' '.join(shell_word(a) for a in argv)} >{log} 2>&1 </dev/null & pid=$!; "
        '[ -z "$term_before_start" ] || kill -TERM $pid 2>/dev/null; '
        "wait $pid; code=$?; while kill -0 $pid 2>/dev/null; do wait $pid; code=$?; done; "
        f"kill -KILL -- -$pid 2>/dev/null; "
        f"for _ in $(seq {GROUP_EXIT_WAIT_TENTHS}); do kill -0 -- -$pid 2>/dev/null || break; sleep 0.1; done; exit "
        "$code"
    )


def srun_argv(job_id: str | None, node: str | None, step_name: str, extra: list[str]) -> list[str]:
    """srun up to the command: a step of one task on one node of the job."""
    argv = ["srun"] + ([f"--jobid={job_id}"] if job_id else []) + list(STEP_OPTIONS)
    if node:
        argv.append(f"--nodelist={node}")
    return argv + [f"--job-name={step_name}", *extra]
