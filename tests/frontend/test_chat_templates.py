"""Chat templates a model's files do not carry: the built-in Gemma template for a GGUF without one (with <end_of_turn>
ending generation), a `--chat-template` file used instead of the model's own, and refusals that name the setting.

The GGUF files here are tiny synthetic ones (a SentencePiece vocabulary and no tensors); the real Gemma 3 270M file
is served with the built-in template in tests/integration/test_gemma3_270m.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import jinja2
import pytest
from ringserve.frontend.launcher import (
    add_serve_arguments,
    check_serve_arguments,
    load_models_config,
    read_metadata,
    startup_models,
)
from ringserve.frontend.text.chat_templates import read_chat_template
from ringserve.frontend.text.tokenizer import tokenizer_from_gguf

TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "▁", "h", "i", "▁hi", "u",
          "s", "e", "r", "m", "o", "d", "l", "user", "model"]  # fmt: skip
CONTROL, NORMAL = 3, 1
MY_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def write_gguf(path: Path, architecture: str, template: str | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_token_types([CONTROL if t.startswith("<") else NORMAL for t in TOKENS])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CONVERSATION = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " hi\n"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]  # fmt: skip


def test_a_gemma_gguf_without_a_template_gets_the_built_in_one_and_stops_at_end_of_turn(tmp_path: Path) -> None:
    tokenizer = tokenizer_from_gguf(write_gguf(tmp_path / "g.gguf", "gemma3"))
    assert tokenizer.chat_template_builtin == "gemma"
    assert tokenizer.eos_token_ids == [1, TOKENS.index("<end_of_turn>")]
    assert tokenizer.render_chat(CONVERSATION) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhi<end_of_turn>\n"
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert tokenizer.render_chat(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n")
    ids = tokenizer.encode_chat(CONVERSATION[1:2])
    assert ids[:2] == [2, TOKENS.index("<start_of_turn>")] and ids.count(2) == 1  # the template's <bos>, no other


@pytest.mark.parametrize(("conversation", "reason"), [
    ([{"role": "assistant", "content": "x"}], "message 0 is assistant, expected user"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 2 is user, expected assistant"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "message 1 is tool"),
    ([{"role": "system", "content": "s"}], "needs a user message"),
])  # fmt: skip
def test_the_gemma_template_refuses_conversations_gemma_cannot_take(tmp_path: Path, conversation: list,
                                                                    reason: str) -> None:  # fmt: skip
    tokenizer = tokenizer_from_gguf(write_gguf(tmp_path / "g.gguf", "gemma3"))
    with pytest.raises(jinja2.TemplateError, match=reason):
        tokenizer.render_chat(conversation)


def test_a_gguf_template_wins_over_the_built_in_one(tmp_path: Path) -> None:
    tokenizer = tokenizer_from_gguf(write_gguf(tmp_path / "g.gguf", "gemma2", template=MY_TEMPLATE))
    assert tokenizer.chat_template_builtin is None and tokenizer.eos_token_ids == [1]
    assert tokenizer.render_chat(CONVERSATION[1:2]) == "[user]  hi\n\n"


def test_a_model_without_any_template_refuses_messages_naming_the_flag(tmp_path: Path) -> None:
    tokenizer = tokenizer_from_gguf(write_gguf(tmp_path / "l.gguf", "llama"))
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template .*--chat-template.*send `text` or `token_ids`"):
        tokenizer.render_chat(CONVERSATION[1:2])


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_chat_template_flag_replaces_the_models_template(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "g.gguf", "gemma3")
    template = tmp_path / "mine.jinja"
    template.write_text(MY_TEMPLATE)
    args = serve_args("--model", str(model), "--chat-template", str(template))
    assert check_serve_arguments(args) is None
    (spec,), _ = startup_models(args)
    assert spec.chat_template == str(template)
    metadata = read_metadata(spec.path, spec.name, spec.chat_template)
    assert metadata.tokenizer.chat_template_builtin is None
    assert metadata.tokenizer.render_chat(CONVERSATION[1:2]) == "[user]  hi\n\n"
    assert read_metadata(spec.path, spec.name).tokenizer.chat_template_builtin == "gemma"
    config = tmp_path / "models.toml"
    config.write_text(f'[[models]]\nmodel = "{model}"\nchat_template = "{template}"\n[[models]]\nname = "b"\n'
                      f'model = "{model}"\n')
    specs, _ = load_models_config(str(config))
    assert [spec.chat_template for spec in specs] == [str(template), None]


def test_bad_chat_template_files_are_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--chat-template .*nope.jinja: cannot read the chat template"):
        read_chat_template(tmp_path / "nope.jinja")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(tmp_path / "empty.jinja")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match=r"broken.jinja: not a valid Jinja template \(line 1"):
        read_chat_template(tmp_path / "broken.jinja")
    (tmp_path / "break.jinja").write_text("{% for m in messages %}{% break %}{% endfor %}")
    assert read_chat_template(tmp_path / "break.jinja")  # the loop controls the renderer has
    args = serve_args("--models-config", str(tmp_path / "m.toml"), "--chat-template", str(tmp_path / "x.jinja"))
    assert "chat_template" in (check_serve_arguments(args) or "")
