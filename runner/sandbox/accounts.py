"""The non-root account a sandbox logs in as (`--user NAME`, as a Pi's `pi`): made once and kept,
with its group allowed on the nodes' engines and no password (sshd needs a usable shadow entry)."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

from runner.core.errors import UserError


def ensure_account(name: str) -> pwd.struct_passwd:
    """The non-root account `--user NAME` logs in as, made if missing: a home, bash, no password
    ('*': sshd without PAM refuses a locked '!' account, which useradd makes by default), no sudo.
    An existing account is used as it is, if sshd can log it in."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", "--user-group",
                               "--password", "*", name], capture_output=True, text=True)
        try:
            account = pwd.getpwnam(name)  # (another sandbox may have made it meanwhile)
        except KeyError:
            why = (made.stderr or made.stdout).strip().splitlines()[-1:] or ["?"]
            raise UserError(f"--user {name}: useradd failed: {why[0]}") from None
    if account.pw_uid == 0:
        raise UserError(f"--user {name}: uid 0 is root; give a non-root account")
    if os.path.basename(account.pw_shell) in ("nologin", "false"):
        raise UserError(f"--user {name}: its shell is {account.pw_shell}, so sshd cannot run commands for it; "
                        f"`usermod -s /bin/bash {name}` or pick another name")
    if shadow_field(name).startswith("!"):
        raise UserError(f"--user {name}: the account is locked ('!' in /etc/shadow) and sshd without PAM refuses "
                        f"it; `usermod -p '*' {name}` unlocks it with no password, or pick another name")
    return account


def engine_group(user: str) -> str:
    """The group a --user node's engine serves its socket to: the account's primary group."""
    import grp

    gid = pwd.getpwnam(user).pw_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def shadow_field(name: str) -> str:
    try:
        for line in Path("/etc/shadow").read_text().splitlines():
            user, _, rest = line.partition(":")
            if user == name:
                return rest.split(":", 1)[0]
    except OSError:
        pass
    return ""
