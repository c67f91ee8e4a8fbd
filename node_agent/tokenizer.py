"""Tokenization and chat templating for a HF-style model dir (``tokenizer.json`` + ``tokenizer_config.json``).

The GGUF converter writes both files from the GGUF metadata, so a converted SmolLM2 dir and a
downloaded HF dir are read the same way. The chat template is rendered with a sandboxed jinja2
environment, like ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from helix.errors import EngineError, RequestError


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTokenizer:
    """Text <-> token ids, plus the model's chat template and stop tokens."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file, cfg_file = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        if not tok_file.is_file():
            raise EngineError(f"{tok_file}: tokenizer file not found")
        self._tok = Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token: str | None = cfg.get("bos_token")
        self.eos_token: str | None = cfg.get("eos_token")
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token) if self.eos_token else None

    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS plus the chat turn terminator if the vocabulary has one."""
        ids = {self.eos_token_id, self.token_id("<|im_end|>"), self.token_id("<|eot_id|>")}
        return tuple(sorted(i for i in ids if i is not None))

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token) if self.add_bos_token and self.bos_token else None
        return [bos, *ids] if bos is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise EngineError("tokenizer_config.json: no chat_template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise RequestError(f"chat template rejected the messages: {exc}", param="messages") from exc
