"""The GGUF tokenizer gives the same ids, text and chat prompts as transformers' GGUF tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from frontend_testkit import real_gguf_path, requires_real_gguf
from ringserve.frontend.text.tokenizer import ModelTokenizer, load_tokenizer

SAMPLES = [
    "Hello world",
    " Hello world",
    "Hello <|im_start|> world<|im_end|>\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>",
    "Ünïcödé façade naïve — \u201cquotes\u201d \u2018single\u2019 …",
    "日本語のテキストと中文文本\uff0c한국어 텍스트",
    "emoji 😀🎉👩‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "tabs\tand\t\ttabs   and    spaces\n\n\n  newline runs\r\n\r\n",
    "                                        ",
    "x" * 300,
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "code: def f(x):\n    return x ** 2  # comment\n\tif a != b: pass",
    "punct!!! ??? ... ;;; ''' \"\"\" ``` <<< >>> @@@ ### $$$",
    "<repo_name>ringserve<file_sep>main.py<jupyter_code>print(1)",
    "<|im_start|",  # an unfinished special token is ordinary text
    "I'm you're they've we'll it's don't I'D",
    "\u200b zero-width \ufeff bom \u00a0 nbsp",
    "mixed😀text€with€multi🙂byte",
    "",
]


@pytest.fixture(scope="module")
def reference_tokenizer():  # type: ignore[no-untyped-def]
    path = real_gguf_path()
    if path is None:
        pytest.skip("set RINGSERVE_TEST_GGUF to a .gguf file")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@requires_real_gguf
@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_ids_and_text_match_transformers(real_tokenizer: ModelTokenizer, reference_tokenizer, text: str) -> None:
    expected_ids = reference_tokenizer.encode(text)
    assert real_tokenizer.encode(text) == expected_ids
    assert real_tokenizer.encode(text, add_special_tokens=False) == reference_tokenizer.encode(
        text, add_special_tokens=False)
    for skip in (False, True):
        assert real_tokenizer.decode(expected_ids, skip_special_tokens=skip) == reference_tokenizer.decode(
            expected_ids, skip_special_tokens=skip)


@requires_real_gguf
def test_gguf_decodes_every_vocab_id_like_transformers(real_tokenizer: ModelTokenizer, reference_tokenizer) -> None:
    ids = list(range(real_tokenizer.vocab_size))
    assert real_tokenizer.vocab_size == len(reference_tokenizer)
    assert [real_tokenizer.decode([i], skip_special_tokens=False) for i in ids] == [
        reference_tokenizer.decode([i], skip_special_tokens=False) for i in ids]


@requires_real_gguf
def test_gguf_special_tokens_match_transformers(real_tokenizer: ModelTokenizer, reference_tokenizer) -> None:
    assert real_tokenizer.bos_token == reference_tokenizer.bos_token
    assert real_tokenizer.eos_token == reference_tokenizer.eos_token
    assert real_tokenizer.eos_token_id == reference_tokenizer.eos_token_id == 2
    assert 2 in real_tokenizer.eos_token_ids


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
    [{"role": "user", "content": "emoji 😀 and <|im_end|> inside\n\n  spaces"}],
]


@requires_real_gguf
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(real_tokenizer: ModelTokenizer, reference_tokenizer,
                                            messages: list[dict[str, str]], add_generation_prompt: bool) -> None:
    expected_text = reference_tokenizer.apply_chat_template(messages, tokenize=False,
                                                            add_generation_prompt=add_generation_prompt)
    assert real_tokenizer.render_chat(messages, add_generation_prompt) == expected_text
    expected_ids = reference_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                           add_generation_prompt=add_generation_prompt)["input_ids"]
    assert real_tokenizer.encode_chat(messages, add_generation_prompt) == list(expected_ids)


def test_chat_template_raise_exception_reports_template_error(tiny_tokenizer: ModelTokenizer) -> None:
    strict = ModelTokenizer(
        backend=tiny_tokenizer.backend,
        chat_template_source="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                             "{% endif %}{{ messages[0]['content'] }}",
    )
    assert strict.render_chat([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="first must be user"):
        strict.render_chat([{"role": "assistant", "content": "no"}])


def test_chat_template_runs_sandboxed(tiny_tokenizer: ModelTokenizer) -> None:
    escaping = ModelTokenizer(backend=tiny_tokenizer.backend,
                              chat_template_source="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escaping.render_chat([{"role": "user", "content": "x"}])


def test_tokenizer_without_template_refuses_messages(tiny_tokenizer: ModelTokenizer) -> None:
    plain = ModelTokenizer(backend=tiny_tokenizer.backend)
    with pytest.raises(ValueError, match="no chat template"):
        plain.render_chat([{"role": "user", "content": "x"}])


def test_hf_folder_loads_tokenizer_template_and_eos_ids(tiny_tokenizer: ModelTokenizer, tmp_path: Path) -> None:
    tiny_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tiny_tokenizer.chat_template_source,
        "eos_token": {"content": "<|im_end|>"},
        "bos_token": "<|im_start|>",
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_tokenizer(tmp_path)
    text = "hello 😀 world"
    assert loaded.encode(text) == tiny_tokenizer.encode(text)
    assert loaded.eos_token == "<|im_end|>"
    assert loaded.eos_token_ids == [tiny_tokenizer.eos_token_id, 2, 0]  # tokenizer's EOS first, then generation's
    assert loaded.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_path_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", [s for s in SAMPLES if s])
def test_no_token_stands_for_more_bytes_than_max_bytes_per_token(real_tokenizer: ModelTokenizer, text: str) -> None:
    """The prompt size bound's premise: tokens >= bytes / max_bytes_per_token, also for the text that packs most
    bytes into a token (the vocabulary's longest token, repeated)."""
    per_token = real_tokenizer.max_bytes_per_token
    for sample in (text, text * 50):
        ids = real_tokenizer.encode(sample, add_special_tokens=False)
        assert len(ids) * per_token >= len(sample.encode())


def test_max_bytes_per_token_is_the_longest_tokens_spelling(real_tokenizer: ModelTokenizer) -> None:
    per_token = real_tokenizer.max_bytes_per_token
    longest = max(real_tokenizer.backend.get_vocab(), key=lambda t: len(real_tokenizer.decode(
        [real_tokenizer.token_to_id(t)], skip_special_tokens=False).encode()))  # fmt: skip
    spelled = real_tokenizer.decode([real_tokenizer.token_to_id(longest)], skip_special_tokens=False)
    assert len(spelled.encode()) == per_token
    assert len(real_tokenizer.encode(spelled * 100, add_special_tokens=False)) * per_token >= len(spelled) * 100


def test_unlocked_encode_and_decode_match_the_plain_ones(real_tokenizer: ModelTokenizer) -> None:
    for text in SAMPLES:
        ids = real_tokenizer.encode(text)
        assert real_tokenizer.encode_unlocked(text) == ids
        assert real_tokenizer.decode_unlocked(ids, skip_special_tokens=False) == real_tokenizer.decode(ids, False)
