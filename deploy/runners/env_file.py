"""Shell text that checks an instance's env file (the instance key and the topology's secrets)
before sourcing it.

A shell sources whatever the file holds as commands, so it must be exactly what `up` wrote: this
user's regular file, readable by no one else, in the deployment's directory that no one else may
write to, under a workdir no one else can rename that directory in (its owner is this user or
root, and it is not writable by others unless sticky, as /tmp is). A group-writable directory is
accepted only when its group is this user's own primary group (a umask of 002 with a group per
user). Anything else stops the launch with one line on stderr naming the path and the fix.
"""
from __future__ import annotations

from typing import Callable

# kvpush_open UID GID MODE: whether others may change a directory's entries (write without the sticky
# bit, or group write for a group other than this user's primary one). %a prints octal digits.
_OPEN_DIR = ('kvpush_open() { if [ $((0$3 & 02)) -ne 0 ] && [ $((0$3 & 01000)) -eq 0 ]; then return 0; fi; '
             'if [ $((0$3 & 020)) -ne 0 ] && [ "$2" != "$kvpush_gid" ]; then return 0; fi; return 1; }; ')


def checked_source_command(env_file: str, quote: Callable[[str], str]) -> str:
    """Checks, then exports every variable env_file sets (`set -a`); ends with '; '. `quote` turns a
    path into a shell word (shlex.quote, or runners.base.shell_word for a path under ~/)."""
    directory = env_file.rsplit("/", 1)[0] or "/"
    workdir = directory.rsplit("/", 1)[0] or "/"
    f, d, w = quote(env_file), quote(directory), quote(workdir)
    fail = 'echo "kvpush: $kvpush_path: {}" >&2; exit 1'
    return (
        "kvpush_uid=$(id -u); kvpush_gid=$(id -g); " + _OPEN_DIR +
        f"kvpush_path={f}; if [ -L {f} ] || [ ! -f {f} ]; then "
        + fail.format("not a regular file (missing, or a link); rerun kvpush up, which writes it") + "; fi; "
        f"set -- $(stat -c '%u %a' -- {f}) $(stat -L -c '%u %g %a' -- {d} {w}); "
        'if [ $# -ne 8 ]; then ' + fail.format("cannot read the owner and mode of it and its directories") + "; fi; "
        'if [ "$1" != "$kvpush_uid" ] || [ $((0$2 & 077)) -ne 0 ]; then '
        + fail.format("is owned by uid $1 with mode $2, not this user's private file (0600); remove it and rerun "
                      "kvpush up, and rotate the secret if others could change it") + "; fi; "
        f"kvpush_path={d}; "
        'if [ "$3" != "$kvpush_uid" ] || kvpush_open "$3" "$4" "$5"; then '
        + fail.format("the deployment's directory is owned by uid $3 with mode $5: it must be this user's and "
                      "writable by no one else; chmod go-w it, or give the host another workdir") + "; fi; "
        f"kvpush_path={w}; "
        'if { [ "$6" != "$kvpush_uid" ] && [ "$6" != 0 ]; } || kvpush_open "$6" "$7" "$8"; then '
        + fail.format("the workdir is owned by uid $6 with mode $8: others could replace the deployment's "
                      "directory in it; give the host a workdir of this user's own") + "; fi; "
        f"set --; set -a; . {f} || exit 1; set +a; "
    )
