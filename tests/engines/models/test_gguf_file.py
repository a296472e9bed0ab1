"""engines/models/gguf_file.py: a GGUF header read directly, against the ``gguf`` package.

Files are written here with ``gguf.GGUFWriter``: every metadata value type, arrays of each
(strings, nested arrays), a 65,536-token vocabulary as llama.cpp stores one (tokens,
scores, types), and tensors in float and block formats. The reader must give what
``gguf.GGUFReader`` gives (metadata as plain values, tensor shapes, types and bytes), and
refuse a file cut short or with impossible counts by :class:`UnsupportedModel`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.models.gguf_file import GgufFile

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
VOCAB = 65_536


def vocabulary(n: int) -> list[str]:
    """Distinct tokens of mixed scripts and lengths (and an empty one)."""
    rng = np.random.default_rng(1)
    alphabet = list("abcdefghij▁ÄöЖж漢字🙂 \n")
    lengths = rng.integers(1, 12, n)
    picks = rng.integers(0, len(alphabet), int(lengths.sum()))
    tokens, at = [""], 0
    for i, k in enumerate(lengths[1:], 1):
        tokens.append(f"{i}" + "".join(alphabet[j] for j in picks[at : at + k]))
        at += k
    return tokens


def write(path: Path) -> dict[str, Any]:
    """A file with every value type and a large vocabulary; returns the tensors written."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🙂")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [["a", "b"], ["c"]])
    w.add_array("t.empty", [])
    tokens = vocabulary(VOCAB)
    w.add_token_list(tokens)
    w.add_token_scores([float(-i) / 7 for i in range(VOCAB)])
    w.add_token_types([1 + i % 6 for i in range(VOCAB)])
    rng = np.random.default_rng(2)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 8)).astype(np.float16),
        "vec": rng.standard_normal(7).astype(np.float32),
    }
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), QT.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=QT.Q8_0)
    tensors["q8"] = q8
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    return path, write(path)


@pytest.fixture(scope="module")
def reader(written: tuple[Path, dict[str, Any]]) -> Any:
    """gguf's own reader of the file (slow: it parses every field part in Python)."""
    return gguf.GGUFReader(str(written[0]))


def test_metadata_equals_gguf_readers(written: tuple[Path, dict[str, Any]], reader: Any) -> None:
    path, _ = written
    ours = GgufFile(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    # gguf's contents() flattens an array of arrays; the reader keeps the nesting
    assert theirs.pop("t.nested") == ["a", "b", "c"]
    assert {k: v for k, v in ours.meta.items() if k != "t.nested"} == theirs
    assert len(ours.meta["tokenizer.ggml.tokens"]) == VOCAB
    assert ours.meta["t.u64"] == 2**63 + 5 and ours.meta["t.bool"] is True
    assert ours.meta["t.nested"] == [["a", "b"], ["c"]]
    assert ours.data_offset == reader.data_offset


def test_tensors_equal_gguf_readers(written: tuple[Path, dict[str, Any]], reader: Any) -> None:
    path, tensors = written
    ours = GgufFile(path)
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        t = ours.tensors[theirs.name]
        assert t.tensor_type == theirs.tensor_type
        assert t.n_elements == int(theirs.n_elements)
        assert t.data.dtype == theirs.data.dtype and t.data.shape == theirs.data.shape
        assert np.array_equal(t.data, theirs.data)
        assert np.array_equal(np.asarray(t.data), tensors[t.name])


def test_opening_reads_no_tensor_data(tmp_path: Path, written: tuple[Path, dict[str, Any]]) -> None:
    """The header is all that opening reads: tensor bytes overwritten with garbage leave the
    metadata and infos as they were, and only the tensors' values change."""
    path, _ = written
    data = bytearray(path.read_bytes())
    offset = GgufFile(path).data_offset
    data[offset:] = b"\xff" * (len(data) - offset)
    (tmp_path / "garbage.gguf").write_bytes(bytes(data))
    ours = GgufFile(tmp_path / "garbage.gguf")
    assert ours.meta == GgufFile(path).meta
    assert np.all(np.asarray(ours.tensors["q8"].data) == 0xFF)


@pytest.mark.parametrize("cut", [0, 3, 10, 30, 100, 5000, -20])
def test_a_cut_file_is_refused(
    cut: int, written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, _ = written
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(UnsupportedModel, match="GGUF"):
        GgufFile(tmp_path / "cut.gguf")


@pytest.mark.parametrize(
    ("at", "value", "message"),
    [
        (0, b"GGUX", "no GGUF magic"),
        (4, (1).to_bytes(4, "little"), "version 1"),
        (8, (2**40).to_bytes(8, "little"), "tensors"),  # tensor count
        (16, (2**40).to_bytes(8, "little"), "metadata keys"),  # key count
        (24, (2**40).to_bytes(8, "little"), "past the end"),  # first key's length
    ],
)
def test_impossible_headers_are_refused(
    at: int, value: bytes, message: str, written: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, _ = written
    data = bytearray(path.read_bytes())
    data[at : at + len(value)] = value
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(UnsupportedModel, match=message):
        GgufFile(tmp_path / "bad.gguf")


def test_invalid_utf8_is_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="llama")
    w.add_string("t.str", "abcd")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = (tmp_path / "x.gguf").read_bytes().replace(b"abcd", b"ab\xffd")
    (tmp_path / "x.gguf").write_bytes(data)
    with pytest.raises(UnsupportedModel, match="not UTF-8"):
        GgufFile(tmp_path / "x.gguf")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small file with nested arrays, strings and tensors: the fuzz test's seed."""
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_array("t.nested", [["a", "bc"], ["d"]])
    w.add_array("t.ints", [1, 2, 3])
    w.add_string("t.str", "xyz")
    w.add_token_list(vocabulary(50))
    w.add_tensor("f32", np.ones((2, 4), np.float32))
    w.add_tensor("q8", np.zeros((2, 68), np.uint8), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.data())
def test_a_damaged_header_reads_or_is_refused(small: bytes, data: st.DataObject) -> None:
    """Bytes of the header overwritten, or the file cut: read, or UnsupportedModel; never
    another exception (nor a hang or a huge allocation)."""
    import tempfile

    blob = bytearray(small)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(bytes(blob))
        try:
            f = GgufFile(path)
        except UnsupportedModel:
            return
        for t in f:  # a file that reads has tensors inside it
            assert t.offset + t.nbytes <= len(blob)
