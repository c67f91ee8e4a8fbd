"""Tokenizer files from a GGUF checkpoint's metadata: ``tokenizer.json`` and ``tokenizer_config.json``.

Owned here, in ``helix/``, because two sides need them and may not import each other: the node
agent's converter (``node_agent.gguf_convert``) writes them into every converted model dir, so an
agent that follows a ``response_format`` grammar (``node_agent.grammar``) has its vocabulary on any
machine; the coordinator (``router.tokenizer``) writes them into a model dir that lacks them. Only
``gguf`` and ``tokenizers`` are needed (no torch). Supported: llama.cpp's ``gpt2`` byte-level BPE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helix.errors import ConfigError

CONTROL_TOKEN_TYPE = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what write_tokenizer_files writes


def write_tokenizer_files(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a GGUF (gpt2 BPE) into ``out_dir``."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(str(gguf_path))
    meta: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConfigError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is unsupported (only gpt2 BPE)",
                          source=str(gguf_path))
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    splits: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if int(t) == CONTROL_TOKEN_TYPE])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILES[0]))

    def name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    config = {"chat_template": meta.get("tokenizer.chat_template"), "bos_token": name("bos"),
              "eos_token": name("eos"), "pad_token": name("padding"), "unk_token": name("unknown"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    (out / TOKENIZER_FILES[1]).write_text(json.dumps(config, indent=2))
    return out
