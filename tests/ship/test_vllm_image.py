"""hack/vllm_image.py's layer, written from a stand-in environment (no 6.3 GB build): the relocated venv
resolves its interpreter inside the image (bin/python -> the base's /usr/bin/python3.11, pyvenv.cfg's home
/usr/bin), `vllm` on the image's PATH runs the launcher with it, libnuma and the model folder are there
under the names the ServedModel and vLLM's kernels use, and the digests written are the blob's and the
tar's. The real image's serving is tests/e2e/test_vllm_cpu_pod.py."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

import vllm_image  # hack/ is on sys.path (tests/conftest.py)


def test_layer_holds_a_relocated_venv_the_launcher_libnuma_and_the_model(tmp_path: Path) -> None:
    env = tmp_path / "env"
    site = env / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("version = 'test'\n")
    (site / "vllm" / "__init__.py").chmod(0o600)  # readable by any UID in the image all the same
    (env / "lib64").symlink_to("lib")
    (env / "bin").mkdir()
    (env / "bin" / "vllm").write_text(f"#!{env}/bin/python\n")  # the build machine's path: left out
    (env / "pyvenv.cfg").write_text(f"home = {tmp_path}/pyenv/bin\n")
    model = tmp_path / "tiny-qwen2.5-instruct-0123456789"
    model.mkdir()
    (model / "config.json").write_text("{}\n")

    digest, diff_id, size = vllm_image.write_layer(env, model, tmp_path / "blobs")
    blob = (tmp_path / "blobs" / digest.removeprefix("sha256:")).read_bytes()
    assert len(blob) == size
    assert hashlib.sha256(blob).hexdigest() == digest.removeprefix("sha256:")
    raw = gzip.decompress(blob)
    assert hashlib.sha256(raw).hexdigest() == diff_id.removeprefix("sha256:")

    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = {m.name: m for m in tar.getmembers()}

        def text(name: str) -> str:
            f = tar.extractfile(members[name])
            assert f is not None, name
            return f.read().decode()

        for name in ("python", "python3", "python3.11"):
            link = members[f"opt/vllm/bin/{name}"]
            assert (link.issym(), link.linkname) == (True, "/usr/bin/python3.11")
        assert "opt/vllm/bin/vllm" not in members
        assert text("opt/vllm/pyvenv.cfg").splitlines()[0] == "home = /usr/bin"
        assert members["opt/vllm/lib64"].linkname == "lib"
        init = members["opt/vllm/lib/python3.11/site-packages/vllm/__init__.py"]
        assert (init.uid, init.gid, init.mode & 0o444) == (0, 0, 0o444)
        assert text("usr/local/bin/vllm").endswith('exec /opt/vllm/bin/python /opt/vllm/launcher.py "$@"\n')
        assert members["usr/local/bin/vllm"].mode & 0o111 == 0o111
        assert text("opt/vllm/launcher.py") == vllm_image.vllm_env.LAUNCHER.read_text()
        assert text(f"opt/app-root/src/{vllm_image.MODEL}/config.json") == "{}\n"
        libs = [n for n in members if n.startswith("usr/lib/") and "/libnuma.so.1" in n]
        assert libs, sorted(members)
