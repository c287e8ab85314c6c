"""Tests for kvfleet_agent.models.tokenizer against transformers' AutoTokenizer on a tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_agent.models.tiny import TINY_BOS_ID, TINY_EOS_ID, init_tiny
from kvfleet_agent.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello world",
    "The model reads a token from the cache.",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs\nand\n\nnewlines\r\n",
    "Numbers 12345 and 3.14159, plus -7!",
    "café naïve Straße façade über",
    "日本語のテキストと中文",
    "Ελλάδα привет — ellipsis…",
    "emoji 🙂🚀 and family 👨‍👩‍👧 and flag 🇫🇷",
    "rare bytes \u0000 \u00ff \U0010ffff",
    "</s> special tokens in the middle <pad> and <unk>",
    "code: def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(init_tiny(str(tmp_path_factory.mktemp("tiny_tok")), "llama"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    t = Tokenizer.from_dir(str(tiny_dir))
    assert t is not None
    return t


@pytest.fixture(scope="module")
def hf_tok(tiny_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


_DELETE = object()  # marker for _edit_json: remove the key


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is _DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")


def _strip_post_processor(d: Path) -> None:
    data = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    tok: Tokenizer, hf_tok: Any, text: str, add_special_tokens: bool
) -> None:
    ours = tok.encode(text, add_special_tokens=add_special_tokens)
    assert ours == hf_tok.encode(text, add_special_tokens=add_special_tokens)
    assert (ours[:1] == [TINY_BOS_ID]) == add_special_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_random_text(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    if text.startswith("<s>"):
        return  # kvfleet deliberately drops the second BOS here; covered by test_never_doubles_bos
    assert tok.encode(text) == hf_tok.encode(text)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_roundtrip_without_special_tokens(tok: Tokenizer) -> None:
    for text in TEXTS:
        if "<" in text:
            continue  # special-token text is removed by skip_special_tokens
        assert tok.decode(tok.encode(text)) == text


def test_metadata(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.bos_token_id == TINY_BOS_ID == hf_tok.bos_token_id
    assert tok.eos_token_ids == [TINY_EOS_ID]
    assert tok.vocab_size == len(hf_tok)
    assert tok.chat_template is not None
    ids = tok.encode("café 🙂 the end")
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.token_to_id("</s>") == TINY_EOS_ID
    assert tok.token_to_id("not-a-token-xyz") is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([tok.vocab_size + 5])


def test_eos_ids_union_generation_config_first(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "generation_config.json", eos_token_id=[3, 2])
    _edit_json(d / "tokenizer_config.json", eos_token={"content": "<unk>", "special": True})
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    assert t.eos_token_ids == [3, 2, 0]
    assert t.eos_token == "<unk>"


def test_eos_ids_deduplicated_and_int_form(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "generation_config.json", eos_token_id=2)
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    assert t.eos_token_ids == [2]


def test_special_tokens_as_dicts(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(
        d / "tokenizer_config.json",
        bos_token={"__type": "AddedToken", "content": "<s>", "lstrip": False},
        eos_token={"__type": "AddedToken", "content": "</s>"},
    )
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    assert (t.bos_token_id, t.bos_token, t.eos_token) == (1, "<s>", "</s>")


def test_without_config_files_uses_generation_config_only(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    assert t.bos_token_id == 1 and t.eos_token_ids == [2]
    assert t.bos_token == "<s>" and t.eos_token == "</s>"
    assert t.chat_template is None
    # The post-processor still adds BOS, exactly once.
    assert t.encode("hello")[:2] == [1, t.encode("hello", add_special_tokens=False)[0]]


def test_explicit_null_bos_token_stays_null_in_template(tiny_dir: Path, tmp_path: Path) -> None:
    # Qwen2-style: no BOS token string, but generation_config still names a bos id.
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", bos_token=None)
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    assert t.bos_token is None and t.bos_token_id == TINY_BOS_ID
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = CONVERSATIONS[0]
    ours = t.apply_chat_template(msgs)
    assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<|user|>")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_malformed_json_names_the_file(tiny_dir: Path, tmp_path: Path, name: str) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    (d / name).write_text('{"bos_token": "<s>",', encoding="utf-8")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Tokenizer.from_dir(str(d))


def test_malformed_tokenizer_json_names_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    (d / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(str(d))


def test_bad_field_types_are_reported(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "generation_config.json", eos_token_id="two")
    with pytest.raises(ValueError, match=r"generation_config\.json.*eos_token_id"):
        Tokenizer.from_dir(str(d))
    d2 = _copy_dir(tiny_dir, tmp_path / "m2")
    _edit_json(d2 / "tokenizer_config.json", bos_token="<nope>")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*bos_token '<nope>'"):
        Tokenizer.from_dir(str(d2))


def test_missing_tokenizer_json_returns_none(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    assert Tokenizer.from_dir(str(d)) is None


def test_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Tokenizer.from_dir(str(tmp_path / "does-not-exist"))


def test_never_doubles_bos(tok: Tokenizer) -> None:
    ids = tok.encode("<s>hello")
    assert ids[0] == TINY_BOS_ID and ids[1] != TINY_BOS_ID
    assert ids[1:] == tok.encode("hello", add_special_tokens=False)
    # Without special tokens the literal BOS in the text is kept as written.
    assert tok.encode("<s>hello", add_special_tokens=False)[0] == TINY_BOS_ID


@pytest.mark.parametrize(
    ("add_bos_token", "tokenizer_class", "expect_bos"),
    [
        (True, "PreTrainedTokenizerFast", True),
        (False, "PreTrainedTokenizerFast", False),
        (_DELETE, "LlamaTokenizerFast", True),
        (_DELETE, "PreTrainedTokenizerFast", False),
    ],
)
def test_bos_added_by_kvfleet_when_post_processor_does_not(
    tiny_dir: Path, tmp_path: Path, add_bos_token: Any, tokenizer_class: str, expect_bos: bool
) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _strip_post_processor(d)
    _edit_json(d / "tokenizer_config.json", add_bos_token=add_bos_token, tokenizer_class=tokenizer_class)
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    plain = t.encode("hello there", add_special_tokens=False)
    assert plain[0] != TINY_BOS_ID
    assert t.encode("hello there") == ([TINY_BOS_ID, *plain] if expect_bos else plain)
    if expect_bos:
        assert t.encode("<s>hello there")[:2] == [TINY_BOS_ID, plain[0]]


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And café?\nMultiline."},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<s><|")
    assert ours.endswith("<|assistant|>\n") == add_generation_prompt


def test_chat_prompt_encodes_with_one_bos(tok: Tokenizer) -> None:
    ids = tok.encode(tok.apply_chat_template(CONVERSATIONS[1]))
    assert ids.count(TINY_BOS_ID) == 1 and ids[0] == TINY_BOS_ID


def test_chat_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
    ],
)
def test_chat_template_validates_messages(tok: Tokenizer, messages: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


def test_chat_template_fallback_without_template(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", chat_template=_DELETE)
    t = Tokenizer.from_dir(str(d))
    assert t is not None and t.chat_template is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.apply_chat_template(msgs) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    assert t.apply_chat_template(msgs, add_generation_prompt=False) == "<|system|>\nS\n<|user|>\nU\n"
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        t.apply_chat_template([{"content": "x"}])


def test_chat_template_jinja_file_and_hf_helpers(tiny_dir: Path, tmp_path: Path, hf_tok: Any) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    # loop controls, tojson with non-ASCII, whitespace control: all rendered the way transformers does.
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}>>> {% endif %}"
    )
    (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = CONVERSATIONS[1]
    ours = t.apply_chat_template(msgs)
    assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.startswith('user: "What is 2+2? 🙂"\n')


def test_chat_template_syntax_error(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", chat_template="{% for m in messages %}")
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    with pytest.raises(ValueError, match="chat_template has a jinja syntax error"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_is_sandboxed(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", chat_template="{{ messages.__class__.__mro__ }}")
    t = Tokenizer.from_dir(str(d))
    assert t is not None
    with pytest.raises(ValueError, match="unsafe"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
