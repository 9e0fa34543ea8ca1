"""spec.adapters: the lora_path each source gives vLLM, --max-lora-rank rounding, the engine flags and env
render derives from the list, and the simulator accepting exactly those flags."""

from __future__ import annotations

from typing import Any

import pytest

from servedmodel.api import ServedModel
from servedmodel.api.adapters import AdapterSpec, max_lora_rank, max_loras
from servedmodel.render import RenderContext, RenderError, deployment, engine_args, render
from servedmodel.sim import cli as sim_cli

CTX = RenderContext()


def cr(spec: dict[str, Any]) -> ServedModel:
    body = {
        "metadata": {"name": "qwen", "namespace": "ai", "uid": "uid-1"},
        "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": "qwen", **spec},
    }
    return ServedModel.model_validate(body)


def env_of(obj: ServedModel) -> dict[str, Any]:
    container = deployment(obj, CTX)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize(
    ("source", "lora_path"),
    [
        ("hf://org/qwen-sql-lora", "org/qwen-sql-lora"),
        ("hf://legacy-name", "legacy-name"),
        ("cache://loras/sql", "/cache/loras/sql"),
        ("cache://loras/sql/", "/cache/loras/sql"),
        ("/opt/loras/sql", "/opt/loras/sql"),
    ],
)
def test_lora_path_of_each_source(source: str, lora_path: str) -> None:
    assert AdapterSpec(name="sql", source=source).lora_path == lora_path


@pytest.mark.parametrize(
    ("ranks", "flag"),
    [([], 16), ([None], 16), ([8], 8), ([8, 16], 16), ([17], 32), ([48, 8], 64), ([300], 320), ([512], 512)],
)
def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts(ranks: list[int | None], flag: int) -> None:
    adapters = [AdapterSpec(name=f"a{i}", source="hf://org/x", rank=r) for i, r in enumerate(ranks)]
    assert max_lora_rank(adapters) == flag


@pytest.mark.parametrize(("count", "flag"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (64, 64)])
def test_max_loras_is_the_count_rounded_up_to_a_power_of_two(count: int, flag: int) -> None:
    assert max_loras([AdapterSpec(name=f"a{i}", source="hf://org/x") for i in range(count)]) == flag


def test_no_adapters_no_lora_flags_nor_env() -> None:
    obj = cr({})
    assert "--enable-lora" not in engine_args(obj.spec)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env_of(obj)


def test_adapters_give_lora_flags_and_runtime_loading() -> None:
    obj = cr(
        {
            "adapters": [
                {"name": "sql", "source": "hf://org/sql", "rank": 8},
                {"name": "poet", "source": "cache://loras/poet", "rank": 24},
            ]
        }
    )
    args = engine_args(obj.spec)
    assert args[-5:] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32"]
    assert "--lora-modules" not in args  # loaded at run time by the prober
    assert env_of(obj)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_hf_adapter_keeps_the_hub_reachable_for_a_pvc_model() -> None:
    on_pvc = {"model": "pvc://store/qwen"}
    assert (
        env_of(cr({**on_pvc, "adapters": [{"name": "sql", "source": "cache://loras/sql"}]}))["HF_HUB_OFFLINE"]
        == "1"
    )
    assert "HF_HUB_OFFLINE" not in env_of(
        cr({**on_pvc, "adapters": [{"name": "sql", "source": "hf://o/sql"}]})
    )


@pytest.mark.parametrize(
    "flag", ["--enable-lora", "--max-loras=4", "--max-lora-rank", "--max_lora_rank=8", "--lora-modules=a=/x"]
)
def test_lora_flags_in_extra_args_are_refused_beside_adapters(flag: str) -> None:
    adapters = [{"name": "sql", "source": "hf://org/sql"}]
    with pytest.raises(RenderError) as info:
        render(cr({"adapters": adapters, "engine": {"extraArgs": [flag]}}), CTX)
    assert info.value.field == "spec.engine.extraArgs"
    # without spec.adapters the flags are the user's own business
    assert flag in engine_args(cr({"engine": {"extraArgs": [flag]}}).spec)


def test_simulator_takes_the_rendered_lora_flags() -> None:
    obj = cr({"engine": {"kind": "simulator"}, "adapters": [{"name": "sql", "source": "/x", "rank": 64}]})
    parser = sim_cli.argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    settings = sim_cli.settings_from_args(parser.parse_args(engine_args(obj.spec)))
    assert settings.lora is not None
    assert (settings.lora.max_loras, settings.lora.max_lora_rank) == (1, 64)


@pytest.mark.parametrize(
    ("adapters", "says"),
    [
        (
            [{"name": "sql", "source": "hf://o/a"}, {"name": "sql", "source": "hf://o/b"}],
            "must be unique: sql",
        ),
        ([{"name": "qwen", "source": "hf://o/a"}], "must differ from the served model name qwen"),
        ([{"name": "sql", "source": "cache://a/../../etc"}], "'..' segment"),
    ],
)
def test_invalid_adapters_say_why(adapters: list[dict[str, Any]], says: str) -> None:
    with pytest.raises(ValueError, match="adapters") as info:
        cr({"adapters": adapters})
    assert says in str(info.value)
