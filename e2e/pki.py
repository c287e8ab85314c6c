"""The local cluster's PKI (CAs, leaf certs, service-account keys; openssl CLI) and the kubeconfigs carrying it."""

from __future__ import annotations

import base64
import shutil
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

from errors import ClusterError
from procs import write_secret


class _Pki:
    """A throwaway CA plus the serving, client and service-account keys, made with the openssl CLI."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca_crt = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self.sa_key = directory / "sa.key"
        self.sa_pub = directory / "sa.pub"

    def _openssl(self, *args: str) -> None:
        """Run openssl in the PKI dir; raise with its stderr on failure."""
        if shutil.which("openssl") is None:
            raise ClusterError("the openssl CLI is needed to make the cluster's certificates")
        proc = subprocess.run(["openssl", *args], cwd=self.dir, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ClusterError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")

    def _key(self, name: str) -> Path:
        """A new P-256 private key (PKCS#8 PEM); Go, Python's ssl and kopf all read it."""
        path = self.dir / f"{name}.key"
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path.name)
        path.chmod(0o600)
        return path

    def _config(self, name: str, subject: dict[str, str], extensions: dict[str, str]) -> Path:
        """A private openssl config, so the system openssl.cnf's defaults never leak in."""
        path = self.dir / f"{name}.cnf"
        dn = "\n".join(f"{k} = {v}" for k, v in subject.items())
        ext = "\n".join(f"{k} = {v}" for k, v in extensions.items())
        path.write_text(f"[req]\nprompt = no\ndistinguished_name = dn\n\n[dn]\n{dn}\n\n[ext]\n{ext}\n")
        return path

    def make_ca(self, name: str = "ca") -> None:
        """A self-signed CA: `ca` signs everything else and is the client CA and KCM's CSR signer."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key(name)
        cnf = self._config(
            name,
            {"CN": f"kvfleet-e2e-{name}"},
            {
                "basicConstraints": "critical,CA:TRUE",
                "keyUsage": "critical,digitalSignature,keyCertSign,cRLSign",
                "subjectKeyIdentifier": "hash",
            },
        )
        self._openssl("req", "-x509", "-new", "-key", f"{name}.key", "-config", cnf.name, "-extensions", "ext",
                      "-days", "3650", "-sha256", "-out", f"{name}.crt")

    def make_cert(self, name: str, subject: dict[str, str], usage: str, sans: Sequence[str] = (),
                  ca: str = "ca") -> tuple[Path, Path]:
        """A leaf cert signed by CA ca; usage is serverAuth and/or clientAuth. Returns (crt, key)."""
        key = self._key(name)
        ext = {
            "basicConstraints": "critical,CA:FALSE",
            "keyUsage": "critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage": usage,
            "authorityKeyIdentifier": "keyid",
        }
        if sans:
            ext["subjectAltName"] = ",".join(sans)
        cnf = self._config(name, subject, ext)
        self._openssl("req", "-new", "-key", key.name, "-config", cnf.name, "-out", f"{name}.csr")
        self._openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
                      "-CAcreateserial", "-days", "365", "-sha256", "-extfile", cnf.name, "-extensions", "ext",
                      "-out", f"{name}.crt")
        return self.dir / f"{name}.crt", key

    def make_sa_keys(self) -> None:
        """The service-account token signing key pair."""
        self._key("sa")
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")


def make_cluster_certs(pki: _Pki, service_ip: str) -> None:
    """Every cert the cluster uses; service_ip (the `kubernetes` Service's ClusterIP) goes in the serving cert."""
    pki.make_ca()
    sans = [
        "IP:127.0.0.1",
        f"IP:{service_ip}",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ]
    # One serving cert for the apiserver, KCM and scheduler: all listen on 127.0.0.1.
    pki.make_cert("serving", {"CN": "kube-apiserver"}, "serverAuth", sans)
    pki.make_cert("admin", {"O": "system:masters", "CN": "kvfleet-admin"}, "clientAuth")
    pki.make_cert("kube-controller-manager", {"CN": "system:kube-controller-manager"}, "clientAuth")
    pki.make_cert("kube-scheduler", {"CN": "system:kube-scheduler"}, "clientAuth")
    pki.make_cert("kwok", {"O": "system:masters", "CN": "kwok-controller"}, "clientAuth")
    # For a real kubelet later: the apiserver's client identity towards kubelets (logs/exec).
    pki.make_cert("apiserver-kubelet-client", {"O": "system:masters", "CN": "kube-apiserver-kubelet-client"},
                  "clientAuth")
    # Front proxy (aggregation layer): the apiserver's identity towards extension API servers, and
    # the CA that KCM/scheduler (delegated authn) read from extension-apiserver-authentication.
    pki.make_ca("front-proxy-ca")
    pki.make_cert("front-proxy-client", {"CN": "front-proxy-client"}, "clientAuth", ca="front-proxy-ca")
    pki.make_sa_keys()


def _b64(path: Path) -> str:
    """File contents, base64-encoded (for kubeconfig *-data fields)."""
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, context: str, ca_crt: Path, user: str, crt: Path, key: Path) -> None:
    """A self-contained kubeconfig (CA, cert and key embedded) for user at server, with one context."""
    text = textwrap.dedent(f"""\
        apiVersion: v1
        kind: Config
        clusters:
        - name: {context}
          cluster:
            server: {server}
            certificate-authority-data: {_b64(ca_crt)}
        users:
        - name: {user}
          user:
            client-certificate-data: {_b64(crt)}
            client-key-data: {_b64(key)}
        contexts:
        - name: {context}
          context:
            cluster: {context}
            user: {user}
        current-context: {context}
        preferences: {{}}
        """)
    write_secret(path, text)
