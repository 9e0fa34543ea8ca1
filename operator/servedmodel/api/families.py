"""Chat template families: the role markers a model family's template must render (the probe's template
check and the rollout gate's fingerprint read them), and how a model id names its family.

The markers are as /tokenize's token_strs join them: a special token, then the role's own token(s).
A family whose template has no marker of its own for a role (Mistral and Gemma fold the system prompt
into the first user turn; DeepSeek writes it bare after BOS) maps that role to None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFamily:
    name: str
    hints: tuple[str, ...]  # lower-case substrings of a served model name or path that mean this family
    roles: Mapping[str, str | None]  # role -> the marker that opens its turn (None: the role has none)
    generation_prompt: str  # what add_generation_prompt ends the rendering with
    turn_end: str | None  # what closes a user turn (None: the next marker does)

    def markers(self, roles: Sequence[str]) -> list[str]:
        """What a rendering of a conversation with these roles (and the generation prompt) must hold."""
        wanted = [m for r in roles if (m := self.roles.get(r)) is not None]
        wanted.append(self.generation_prompt)
        if self.turn_end is not None and "user" in roles:
            wanted.append(self.turn_end)
        return list(dict.fromkeys(wanted))


def _headers(open_: str, close: str) -> dict[str, str | None]:
    return {r: f"{open_}{r}{close}" for r in ("system", "user", "assistant")}


# DeepSeek's markers are written with the full-width bar U+FF5C, not "|".
_BAR = "\uff5c"
_DS_USER, _DS_ASSISTANT = f"<{_BAR}User{_BAR}>", f"<{_BAR}Assistant{_BAR}>"

# First match wins: DeepSeek's distills of Qwen and Llama carry DeepSeek's template, so it comes first.
FAMILIES: tuple[ChatFamily, ...] = (
    ChatFamily(
        "deepseek",
        ("deepseek",),
        {"system": None, "user": _DS_USER, "assistant": _DS_ASSISTANT},
        _DS_ASSISTANT,
        None,
    ),
    ChatFamily("chatml", ("qwen",), _headers("<|im_start|>", ""), "<|im_start|>assistant", "<|im_end|>"),
    ChatFamily(
        "llama3",
        ("llama-3", "llama3"),
        _headers("<|start_header_id|>", "<|end_header_id|>"),
        "<|start_header_id|>assistant<|end_header_id|>",
        "<|eot_id|>",
    ),
    ChatFamily(
        "granite",
        ("granite",),
        _headers("<|start_of_role|>", "<|end_of_role|>"),
        "<|start_of_role|>assistant<|end_of_role|>",
        "<|end_of_text|>",
    ),
    ChatFamily(
        "gemma",
        ("gemma",),
        {"system": None, "user": "<start_of_turn>user", "assistant": "<start_of_turn>model"},
        "<start_of_turn>model",
        "<end_of_turn>",
    ),
    ChatFamily(
        "mistral",
        ("mistral", "mixtral", "ministral"),
        {"system": None, "user": "[INST]", "assistant": None},
        "[/INST]",
        "[/INST]",
    ),
)


def family_of(*names: str | None) -> ChatFamily | None:
    """The family of the served model name or its path (/v1/models `id`, `root`), or None."""
    for name in names:
        low = (name or "").lower()
        for family in FAMILIES:
            if any(hint in low for hint in family.hints):
                return family
    return None
