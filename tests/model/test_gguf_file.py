"""Our GGUF container reader (model/gguf_file.py) against the gguf package's
GGUFReader: the same metadata values and the same tensor bytes, on the default
model (made by llama.cpp's converter), the K-quant fixtures (llama-quantize),
and a file that gguf's own GGUFWriter fills with every metadata type, both
byte orders; and a clear error for every way a file can be wrong."""

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from folio.model.gguf_file import GGUFFile  # noqa: E402
from tests.utils import default_gguf_path  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"


def every_type_file(path: Path, endianess=None) -> Path:
    """Every metadata value type, arrays of numbers, strings and arrays, and
    tensors of typed and block-quantized kinds at an unusual alignment."""
    kwargs = {} if endianess is None else {"endianess": endianess}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.0])
    w.add_array("t.strs", ["", "a", "ĠĊ", "<|im_end|>"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_gguf(path) -> GGUFFile:
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    their_fields = {k: f.contents() for k, f in theirs.fields.items()
                    if not k.startswith("GGUF.")}          # its header pseudo-fields
    assert list(ours.fields) == list(their_fields)
    for key, value in their_fields.items():
        if isinstance(ours.fields[key], list) and ours.fields[key] and \
                isinstance(ours.fields[key][0], list):
            continue        # arrays of arrays: gguf's contents() flattens them
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist())
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes,
                                                              b.data_offset)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


@pytest.mark.parametrize("name", ["default", "tiny-llama-Q4_K_M.gguf",
                                  "tiny-llama-Q5_K_M.gguf"])
def test_real_files_read_as_the_gguf_package_reads_them(name):
    path = default_gguf_path() if name == "default" else FIXTURES / name
    ours = assert_same_as_gguf(path)
    assert len(ours.tensors) > 10 and ours.fields["general.architecture"] == "llama"


@pytest.mark.parametrize("endianess", [None, "big"])
def test_every_value_type_and_byte_order(tmp_path, endianess):
    order = None if endianess is None else gguf.GGUFEndian.BIG
    ours = assert_same_as_gguf(every_type_file(tmp_path / "t.gguf", order))
    assert ours.endian == (">" if endianess else "<")
    assert ours.fields["t.strs"] == ["", "a", "ĠĊ", "<|im_end|>"]
    assert ours.fields["t.nested"] == [[1, 2], [3]]
    assert ours.fields["t.u64"] == 2 ** 63 + 5
    data = {t.name: t for t in ours.tensors}
    assert all(t.data_offset % 64 == 0 for t in ours.tensors)
    assert data["q8"].data.shape == (4, 2 * 34) and data["q8"].data.dtype == np.uint8
    assert data["f16"].data.shape == (2, 64) and data["f16"].shape == (64, 2)


def _header(version=3, tensors=0, fields=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, fields)


@pytest.mark.parametrize("data, message", [
    (b"", "empty file"),
    (b"GGML" + bytes(40), "not a GGUF file"),
    (_header(version=1), "GGUF version 1 is not supported"),
    (_header(fields=1) + struct.pack("<Q", 1000) + b"key", "cut short"),
    (_header(fields=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77),
     "unknown metadata value type 77"),
    (_header(fields=1) + struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<IB", 0, 1),
     "cut short or corrupt"),
    (_header(tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<I2QIQ", 2, 32, 4, 0, 0),
     "tensor w runs past the end of the file"),
    (_header(tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<I2QIQ", 2, 20, 4, 8, 0),
     "rows of 20 are not whole Q8_0 blocks of 32"),
    (_header(tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<I1QIQ", 1, 4, 999, 0),
     "unknown ggml type 999"),
])
def test_a_wrong_file_is_a_clear_error(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(str(path))


def test_a_name_twice_is_refused(tmp_path):
    info = struct.pack("<Q", 1) + b"w" + struct.pack("<I1QIQ", 1, 4, 0, 0)
    path = tmp_path / "twice.gguf"
    path.write_bytes(_header(tensors=2) + info + info + bytes(64))
    with pytest.raises(ValueError, match="a tensor name appears twice"):
        GGUFFile(str(path))
