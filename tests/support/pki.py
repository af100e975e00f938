"""A throw-away PKI made with the openssl CLI: a CA, a server and a client certificate, and a rogue one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

OPENSSL = shutil.which("openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, name: str, ca: str, subject: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)


def make_pki(d: Path) -> Path:
    """Fill ``d``: ca.crt; server.{crt,key} for localhost/127.0.0.1; client.{crt,key} from ca;
    rogue.{crt,key} from another CA. Needs the openssl CLI (OPENSSL is None without it)."""
    _ca(d, "ca")
    _ca(d, "otherca")
    _issue(d, "server", "ca", "/CN=localhost",
           "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _issue(d, "client", "ca", "/CN=learner-1", "extendedKeyUsage=clientAuth\n")
    _issue(d, "rogue", "otherca", "/CN=rogue", "extendedKeyUsage=clientAuth\n")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return d
