"""Chat templates: where they come from, how they render, and text deltas cut at stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.document.text import TextStream
from sessiontape.core.errors import ConfigError, InvalidParameters
from sessiontape.engines.byte_tokenizer import ByteTokenizer
from sessiontape.transports.http.openai.chat_template import (
    ROLE_MARKERS,
    ChatTemplate,
    load_template,
    message_text,
)
from tests.helpers.config import make_config

CUSTOM = {
    "name": "brackets",
    "message": "[{role}] {content}\n",
    "generation_prompt": "[assistant] ",
    "after_generation": "\n",
    "prefix": "<s>",
    "stop": ["[user]"],
}


def test_role_markers_render() -> None:
    text = ROLE_MARKERS.render(
        [("system", "S"), ("user", "U")], at_start=True, after_generation=False
    )
    assert text == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    more = ROLE_MARKERS.render([("user", "again")], at_start=False, after_generation=True)
    assert more == "\n<|user|>\nagain\n<|assistant|>\n"


def test_template_sources(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"
    assert load_template(make_config(url)) == ROLE_MARKERS
    from_table = load_template(make_config(url, transports={"http": {"chat_template": CUSTOM}}))
    assert (
        from_table.render([("user", "hi")], at_start=True, after_generation=False)
        == "<s>[user] hi\n[assistant] "
    )
    path = tmp_path / "tpl.json"
    path.write_text(json.dumps(CUSTOM))
    assert (
        load_template(make_config(url, transports={"http": {"chat_template": str(path)}}))
        == from_table
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "chat_template.json").write_text(json.dumps({**CUSTOM, "name": "folder"}))
    cfg = make_config(url, engine={"name": "onnx", "options": {"model_dir": str(model_dir)}})
    assert load_template(cfg).name == "folder"
    # the config wins over the model folder
    cfg = make_config(
        url,
        engine={"name": "onnx", "options": {"model_dir": str(model_dir)}},
        transports={"http": {"chat_template": CUSTOM}},
    )
    assert load_template(cfg).name == "brackets"
    assert ChatTemplate.from_json(from_table.to_json()) == from_table


def test_bad_templates(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        ChatTemplate.from_json({"mesage": "x"})
    with pytest.raises(ConfigError, match="role"):
        ChatTemplate.from_json({"message": "{speaker}: {content}"})
    with pytest.raises(ConfigError):
        load_template(
            make_config(
                f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
                transports={"http": {"chat_template": str(tmp_path / "missing.json")}},
            )
        )


def test_message_text() -> None:
    assert message_text("plain", "m") == "plain"
    assert (
        message_text([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}], "m")
        == "ab"
    )
    with pytest.raises(InvalidParameters, match="image_url"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}], "m")


def deltas(text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    tok = ByteTokenizer()
    ts = TextStream(tok.decode, stops)
    out = [ts.push(b) for b in text.encode()]
    out.append(ts.finish())
    return out, ts


def test_text_stream_holds_split_characters() -> None:
    out, ts = deltas("añ€😀")
    assert "".join(out) == "añ€😀" and ts.text == "añ€😀" and not ts.stopped
    assert "\ufffd" not in "".join(out)
    assert [d for d in out if d] == ["a", "ñ", "€", "😀"]


def test_text_stream_stops_before_a_stop_string() -> None:
    out, ts = deltas("ok <|us then <|user|> hidden", ("<|user|>",))
    assert "".join(out) == "ok <|us then " and ts.stopped and ts.text == "ok <|us then "
    # a prefix of a stop string is held back until it cannot be one
    out, _ = deltas("a<|b", ("<|user|>",))
    assert out[1:3] == ["", ""] and "".join(out) == "a<|b"


def test_text_stream_keeps_sentencepiece_spaces() -> None:
    """A tokenizer that drops a word's leading space at the start of a text: deltas still
    add up to the decode of the whole run."""
    pieces = {1: "▁Hello", 2: "▁big", 3: "▁world", 4: "!"}

    def detok(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    ts = TextStream(detok)
    out = [ts.push(i) for i in (1, 2, 3, 4)] + [ts.finish()]
    assert "".join(out) == "Hello big world!" == detok([1, 2, 3, 4])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    data=st.binary(max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=6), max_size=20),
    stops=st.lists(st.sampled_from(["a", "<|u", "\u00e9!", "zz"]), max_size=2),
)
def test_text_stream_extend_is_push_token_by_token(
    data: bytes, cuts: list[int], stops: list[str]
) -> None:
    """Tokens pushed a run at a time (``extend``) give the same text, the same stop and,
    joined, the same deltas as the same tokens pushed one by one."""
    tok = ByteTokenizer()
    one = TextStream(tok.decode, stops)
    one_out = "".join(one.push(b) for b in data) + one.finish()
    runs = TextStream(tok.decode, stops)
    out, i = [], 0
    for k in [*cuts, len(data)]:
        out.append(runs.extend(list(data[i : i + k])))
        i += k
    out.append(runs.finish())
    assert "".join(out) == one_out == runs.text == one.text
    assert runs.stopped == one.stopped
