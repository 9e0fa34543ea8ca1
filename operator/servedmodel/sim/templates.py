"""Chat templates rendered with Jinja, as vLLM's `--chat-template` does (HF's sandboxed environment).

Bundled (package data, templates/*.jinja): qwen2.5 (ChatML with Qwen's default system prompt; the default),
qwen3 (ChatML, no default system prompt, `enable_thinking` via chat_template_kwargs), llama3 and plain —
the last two render no `<|im_start|>` markers, which is how a template mismatch is staged.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

BUNDLED = ("qwen2.5", "qwen3", "llama3", "plain")


class ChatTemplateError(ValueError):
    """The template could not render these messages (vLLM answers 400)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def bundled_source(name: str) -> str:
    return (importlib.resources.files("servedmodel.sim") / "templates" / f"{name}.jinja").read_text()


def default_template_name(model: str) -> str:
    """The template a real checkpoint of this name ships: Qwen3 for qwen3 names, else Qwen2.5's ChatML."""
    lowered = model.lower()
    return "qwen3" if "qwen3" in lowered else "qwen2.5"


def resolve_source(spec: str) -> tuple[str, str]:
    """`--chat-template` value → (name, Jinja source): a bundled name, a file path, or the template itself."""
    if spec in BUNDLED:
        return spec, bundled_source(spec)
    path = Path(spec)
    if "{" not in spec and path.is_file():
        return path.stem, path.read_text()
    if "{{" in spec or "{%" in spec:
        return "inline", spec
    raise ValueError(
        f"chat template {spec!r} is neither a bundled name ({', '.join(BUNDLED)}), a file, nor Jinja"
    )


class ChatTemplate:
    """A compiled chat template; `render(messages, ...)` returns the prompt text."""

    def __init__(
        self, spec: str, *, bos_token: str = "<|begin_of_text|>", eos_token: str = "<|im_end|>"
    ) -> None:
        self.name, self.source = resolve_source(spec)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.source)
        self._bos = bos_token
        self._eos = eos_token

    @property
    def is_qwen3(self) -> bool:
        return "enable_thinking" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        kwargs = dict(chat_template_kwargs or {})
        try:
            text: str = self._template.render(
                messages=[_normalize(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self._bos,
                eos_token=self._eos,
                **kwargs,
            )
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(str(exc)) from exc
        return text


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts → one string (vLLM's "string" content format), None content → ''."""
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type", "text") == "text"
        )
    return out


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last user message (what the simulator echoes), '' if none."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return str(_normalize(message)["content"])
    return ""
