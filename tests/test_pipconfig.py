"""The package index as pip sees it: pip.conf's index, extra index and CA bundle are honoured.

Every test names its own pip configuration through ``$PIP_CONFIG_FILE`` (conftest points it
at /dev/null and drops ``PIP_*``), so none depends on this machine's pip settings.
"""

from __future__ import annotations

import subprocess

import pytest
from packaging.version import Version

from k3overlay import cli, errors, pipconfig, source

from .fake_index import FakeIndex, serve
from .test_mirror import sdist_bytes

V = Version("0.1.0")


def pip_conf(tmp_path, monkeypatch, **options: str):
    """A pip.conf with ``options`` in ``[global]``, named by ``$PIP_CONFIG_FILE`` for this test."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k.replace('_', '-')} = {v}\n" for k, v in options.items()))
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    return conf


def publish(index: FakeIndex, text: str = "A = 1\n") -> None:
    index.publish("vllm-0.1.0.tar.gz", sdist_bytes("0.1.0", {"vllm/a.py": text}))


@pytest.fixture
def index():
    served = FakeIndex()
    server = serve(served)
    yield served
    server.shutdown()
    server.server_close()


@pytest.fixture
def tls_index(tmp_path):
    """A fake index over HTTPS whose certificate a private CA signed (a company mirror)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                           "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                           "-keyout", str(key), "-out", str(cert)], capture_output=True)
    if made.returncode:
        pytest.skip(f"openssl cannot make a certificate here: {made.stderr[-200:]!r}")
    served = FakeIndex()
    server = serve(served, tls=(str(cert), str(key)))
    yield served, cert
    server.shutdown()
    server.server_close()


def test_pip_conf_index_url_is_honoured(index, tmp_path, monkeypatch):
    publish(index)
    pip_conf(tmp_path, monkeypatch, index_url=index.url)
    files = source.release_files()
    assert files.settings.indexes == (index.url,)
    assert files.use(files.sdist(V), lambda path: path.read_bytes()) == index.files["vllm-0.1.0.tar.gz"]


def test_pip_conf_extra_index_is_read_and_a_dead_one_passed_over(index, tmp_path, monkeypatch, capsys):
    publish(index)
    pip_conf(tmp_path, monkeypatch, index_url="http://127.0.0.1:9/simple/", extra_index_url=index.url)
    files = source.release_files()
    assert files.settings.indexes == ("http://127.0.0.1:9/simple/", index.url)
    assert files.sdist(V).filename == "vllm-0.1.0.tar.gz"
    assert "passed over" in capsys.readouterr().err


def test_pip_variables_override_pip_conf_as_in_pip(index, tmp_path, monkeypatch):
    pip_conf(tmp_path, monkeypatch, index_url="http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    assert source.release_files().settings.indexes == (index.url,)


def test_pip_conf_no_index_lists_nothing(index, tmp_path, monkeypatch):
    publish(index)
    pip_conf(tmp_path, monkeypatch, index_url=index.url, no_index="true")
    with pytest.raises(errors.UsageError, match="has no release sdist"):
        source.release_files().sdist(V)


def test_pip_conf_cert_reaches_an_index_behind_a_private_ca(tls_index, tmp_path, monkeypatch):
    index, cert = tls_index
    publish(index)
    pip_conf(tmp_path, monkeypatch, index_url=index.url)
    with pytest.raises(errors.SourceError, match="cannot reach the package index: .*CERTIFICATE_VERIFY_FAILED"):
        source.release_files().sdist(V)  # the system trust store does not know the private CA
    pip_conf(tmp_path, monkeypatch, index_url=index.url, cert=str(cert))
    files = source.release_files()
    assert files.settings.cert == str(cert)
    assert files.use(files.sdist(V), lambda path: path.read_bytes()) == index.files["vllm-0.1.0.tar.gz"]


def test_apply_reaches_pip_confs_index_exit_6_one_line_redacted(project, tmp_path, monkeypatch, capsys):
    """apply.py with the index named only in pip.conf, with a token in its URL: that index is
    the one tried (exit 6, one line), and the token is in no output."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    pip_conf(tmp_path, monkeypatch, index_url="http://k3user:s3cr3t-t0ken@127.0.0.1:9/simple/")
    out = tmp_path / "r.json"
    assert cli.main(["--workdir", str(tmp_path / "wd"), "-q", "--vllm-ref", "v1.0.0",
                     "--json", str(out)]) == errors.SOURCE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("apply.py: error: cannot reach the package index: ") and "port=9" in err[-1]
    assert "s3cr3t" not in "\n".join(err) + out.read_text()


def test_parse_takes_pips_order_and_quoting():
    listing = ("global.index-url='https://a.example/simple'\n"
               "global.extra-index-url='https://b.example/simple https://c.example/simple'\n"
               "download.index-url='https://d.example/simple'\n"
               ":env:.cert='/etc/company-ca.pem'\n"
               "global.cert='/etc/other.pem'\n")
    got = pipconfig.parse(listing)
    assert got.indexes == ("https://d.example/simple", "https://b.example/simple", "https://c.example/simple")
    assert got.cert == "/etc/company-ca.pem"
    assert pipconfig.parse("").indexes == (pipconfig.PYPI,)


def test_settings_without_pip_are_pips_defaults(tmp_path):
    assert pipconfig.settings(str(tmp_path / "no-python")) == pipconfig.IndexSettings()


def test_a_file_index_without_vllm_is_passed_over_quietly(index, tmp_path, monkeypatch, capsys):
    """pip's configuration may name local folders as extra indexes (file://); one without vLLM
    is nothing to miss, one with it cannot be read by requests and is named."""
    publish(index)
    empty, with_vllm = tmp_path / "empty-simple", tmp_path / "local-simple"
    empty.mkdir()
    (with_vllm / "vllm").mkdir(parents=True)
    pip_conf(tmp_path, monkeypatch, index_url=index.url, extra_index_url=f"file://{empty} file://{with_vllm}")
    assert source.release_files().sdist(V).filename == "vllm-0.1.0.tar.gz"
    err = capsys.readouterr().err
    assert str(empty) not in err and f"file://{with_vllm}/vllm/" in err and "passed over" in err
