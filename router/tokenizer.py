"""Tokenization and the chat template, on the coordinator, without torch.

The coordinator tokenizes prompts and detokenizes sampled tokens itself (agents only see ids).
It reads a Hugging Face–style model dir: ``tokenizer.json`` (the ``tokenizers`` library) and
``tokenizer_config.json`` (chat template rendered with jinja2, special tokens). When the dir
lacks those files, :func:`ensure_tokenizer_dir` writes them from a GGUF file's metadata
(``helix.gguf_tokenizer``, shared with the agents' converter, so no torch here).

:class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas that never
split a multi-byte character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helix.errors import ConfigError
from helix.gguf_tokenizer import TOKENIZER_FILES, write_tokenizer_files
from helix.smollm2 import CACHE_ROOT as DEFAULT_CACHE_ROOT
from helix.smollm2 import smollm2_gguf_path

__all__ = ["ChatTokenizer", "IncrementalDetokenizer", "ensure_tokenizer_dir", "write_tokenizer_files"]


def default_model_dir() -> Path:
    """Where the engine's converter caches SmolLM2 (``$HELIX_CACHE/<gguf stem>``)."""
    return DEFAULT_CACHE_ROOT / smollm2_gguf_path().stem


def ensure_tokenizer_dir(model_dir: str | Path | None, gguf_path: str | Path | None = None) -> Path:
    """A dir holding the tokenizer files: ``model_dir`` if complete, else written from the GGUF."""
    target = Path(model_dir) if model_dir else default_model_dir()
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    gguf = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    return write_tokenizer_files(gguf, target)


@dataclass(slots=True)
class ChatTokenizer:
    """Encode, decode, and render chat messages with the model's own template."""

    model_dir: Path
    tokenizer: Any = field(repr=False)
    chat_template: str | None
    special_tokens: dict[str, str | None]
    add_bos_token: bool
    eos_token_ids: frozenset[int]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ConfigError("tokenizer.json not found", source=str(d))
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        tokenizer = Tokenizer.from_file(str(tok_file))
        specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos_ids = {tokenizer.token_to_id(t) for t in (specials["eos_token"], "<|endoftext|>") if t}
        gen_cfg = d / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos_ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return cls(model_dir=d, tokenizer=tokenizer, chat_template=cfg.get("chat_template"),
                   special_tokens=specials, add_bos_token=bool(cfg.get("add_bos_token", False)),
                   eos_token_ids=frozenset(i for i in eos_ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        bos = self.special_tokens.get("bos_token")
        if self.add_bos_token and bos:
            bos_id = self.tokenizer.token_to_id(bos)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids.insert(0, bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``)."""
        if not self.chat_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return _compiled(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.special_tokens.get("bos_token") or "", eos_token=self.special_tokens.get("eos_token") or "",
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in some HF configs
        return value.get("content")
    return value


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    template = _TEMPLATES.get(source)
    if template is None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = _TEMPLATES[source] = env.from_string(source)
    return template


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text deltas for a growing token list, decoding only a short window each time (as TGI does).

    A delta is released only when it does not end inside an unfinished UTF-8 character.
    """

    tokenizer: ChatTokenizer
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
