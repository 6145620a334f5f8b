"""The real server process with keys (python -m megatron_async.serve --api-key / MEGATRON_ASYNC_API_KEY,
--admin-api-key): the official openai client with ``api_key=`` works unchanged, a wrong or missing
key is its AuthenticationError (401), /health stays open, the admin routes take their own key,
neither key ever reaches the server's output; the server refuses to start its admin endpoints on
a reachable host without an admin key; HTTPS with --ssl-keyfile / --ssl-certfile."""
import datetime
import http.client
import ipaddress
import json
import ssl
import subprocess
import sys
from urllib.parse import urlparse

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async.serve.process import ServerProcess  # noqa: E402

API, ADMIN = "sk-test-api-5f3c9a", "sk-test-admin-77d1e2"
FLAGS = ["--default-model", "tiny", "--device", "cpu", "--max-requests", "4", "--num-kv-blocks", "64",
         "--log-level", "debug"]


def status_of(url: str, method: str, path: str, key: str | None = None, body: bytes | None = None) -> int:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_keys_through_the_openai_client():
    with ServerProcess([*FLAGS, "--admin-api-key", ADMIN, "--enable-admin-endpoints"],
                       env={"MEGATRON_ASYNC_API_KEY": API}) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API, max_retries=0, timeout=60)
        out = client.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=4, temperature=0.0)
        assert len(out.choices[0].text) > 0 or out.usage.completion_tokens == 4
        assert len(list(client.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=3,
                                                  stream=True))) >= 2
        assert [m.id for m in client.models.list()] == [srv.model_name]
        for wrong in ("sk-wrong", ADMIN):
            bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=wrong, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError) as e:
                bad.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=2)
            assert e.value.status_code == 401 and wrong not in str(e.value)
        assert status_of(srv.url, "GET", "/v1/models") == 401
        assert status_of(srv.url, "GET", "/health") == 200 and status_of(srv.url, "GET", "/metrics") == 200
        assert status_of(srv.url, "POST", "/resume_generation", API, b"{}") == 401
        assert status_of(srv.url, "POST", "/resume_generation", ADMIN, b"{}") == 200
        output = srv.output()
    assert API not in output and ADMIN not in output


def test_refuses_admin_endpoints_on_a_reachable_host_without_an_admin_key():
    proc = subprocess.run([sys.executable, "-m", "megatron_async.serve", *FLAGS, "--enable-admin-endpoints",
                           "--host", "0.0.0.0", "--port", "0", "--api-key", API], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "needs --admin-api-key" in proc.stderr, proc.stderr
    assert API not in proc.stderr + proc.stdout and "serving" not in proc.stdout


def _self_signed(tmp_path):
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return keyfile, certfile


def test_https(tmp_path):
    keyfile, certfile = _self_signed(tmp_path)
    with ServerProcess([*FLAGS, "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile),
                        "--api-key", API]) as srv:
        assert srv.url.startswith("https://")
        u = urlparse(srv.url)
        conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=60,
                                           context=ssl.create_default_context(cafile=str(certfile)))
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {API}"})
        r = conn.getresponse()
        assert r.status == 200 and len(json.loads(r.read())["choices"]) == 1
        conn.close()
        plain = http.client.HTTPConnection(u.hostname, u.port, timeout=10)  # plain HTTP on the TLS port: no answer
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/health")
            plain.getresponse()
