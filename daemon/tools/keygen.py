"""``kvswap keygen``: a CURVE keypair for the daemon or for one engine.

Writes ``NAME.key`` (the public key, to hand out: into the daemon's authorized-keys directory
for an engine, to the engines for the daemon) and ``NAME.key_secret`` (stays where it was
made), both ZMQ certificate files, mode 0600, in a 0700 directory.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import click

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def write_keypair(directory: str, name: str) -> tuple[str, str]:
    """Create ``directory/name.key`` and ``directory/name.key_secret``; return their paths.
    Refuses to overwrite an existing key (raises ``FileExistsError``)."""
    import zmq.auth

    if _NAME_RE.fullmatch(name) is None:
        raise ValueError("a key name is letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists; remove it first or choose another name")
    # zmq.auth writes with the process umask; writing inside a fresh 0700 directory and
    # tightening before the files move into place leaves no moment where the secret is open.
    staging = tempfile.mkdtemp(prefix=".keygen-", dir=directory)
    try:
        made_public, made_secret = zmq.auth.create_certificates(staging, name)
        for made in (made_public, made_secret):
            os.chmod(made, 0o600)
        # link + unlink, not rename: never replaces a key that appeared in the meantime.
        os.link(made_public, public_path)
        try:
            os.link(made_secret, secret_path)
        except BaseException:
            os.unlink(public_path)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return public_path, secret_path


@click.command()
@click.argument("name")
@click.option("--dir", "directory", default=".", help="Directory to write NAME.key and NAME.key_secret to.")
def keygen(name: str, directory: str) -> None:
    """Write a CURVE keypair NAME.key (public) and NAME.key_secret (secret), mode 0600.

    For the daemon: kvswapd --curve-secret-key-file DIR/NAME.key_secret, and give NAME.key to
    the engines. For an engine: copy NAME.key into the daemon's --authorized-keys directory.
    """
    try:
        public_path, secret_path = write_keypair(directory, name)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"public key: {public_path}")
    click.echo(f"secret key: {secret_path}")
