"""``helix keys``: write the CURVE key pairs of a cluster (ZeroMQ certificates, via ``zmq.auth``).

``helix keys DIR --cluster cluster.yaml`` writes one pair for the coordinator and for every node of
the cluster file; ``helix keys DIR NAME ...`` one per name. Each pair is two files in ZeroMQ's
certificate format (Z85 keys in text): ``NAME.key`` (the public key: share it) and
``NAME.key_secret`` (both keys: keep it on NAME's machine only, mode 0600). Existing files are never
overwritten unless ``--force``. The cluster file then names the public keys with ``keys_dir: DIR``
(or a ``public_key`` per vertex, printed here); docs/gpu.md has the steps.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from helix.errors import ConfigError


def add_keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="directory to write NAME.key and NAME.key_secret into (created)")
    p.add_argument("names", metavar="NAME", nargs="*", help="vertex ids to make key pairs for (node ids, the coordinator's)")
    p.add_argument("--cluster", help="make a pair for the coordinator and every node of this cluster file")
    p.add_argument("--force", action="store_true", help="overwrite existing key files")


def run_keys(args: argparse.Namespace) -> int:
    import zmq.auth
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from helix.keys import PUBLIC_SUFFIX, SECRET_SUFFIX, read_certificate

    names = list(args.names)
    if args.cluster:
        from helix.spec import load_cluster

        cluster = load_cluster(args.cluster)
        names += [cluster.coordinator.id, *cluster.node_ids]
    names = list(dict.fromkeys(names))
    if not names:
        raise ConfigError("name the key pairs to make: NAME ... or --cluster FILE", field="NAME")
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"{name!r} cannot name a key file", field="NAME")
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("exists and is not a directory", source=str(out))
    if not args.force:
        taken = [str(out / f"{n}{suffix}") for n in names for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)
                 if (out / f"{n}{suffix}").exists()]  # fmt: skip
        if taken:
            raise ConfigError(f"key files exist already: {', '.join(taken)} (--force overwrites them: every peer "
                              "must then get the new public keys)", field="DIR")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    table = Table(title=f"CURVE key pairs in {out}")
    table.add_column("name")
    table.add_column("public_key", no_wrap=True, min_width=40)
    table.add_column("secret certificate")
    for name in names:
        public_file, secret_file = zmq.auth.create_certificates(out, name)
        os.chmod(secret_file, 0o600)
        # Text: a Z85 key may hold "[...]", which rich would read as markup
        table.add_row(Text(name), Text(read_certificate(public_file)[0].decode()), Text(str(secret_file)))
    console = Console(highlight=False)
    console.print(table)
    keys_dir = os.path.relpath(out.resolve(), Path(args.cluster).resolve().parent) if args.cluster else str(out)
    where = "" if args.cluster else " (relative to the cluster file)"
    console.print(f"In the cluster file: [bold]keys_dir: {escape(keys_dir)}[/]{where}, or each vertex's public_key above. "
                  "Copy NAME.key_secret to NAME's machine only.", soft_wrap=True)
    return 0
