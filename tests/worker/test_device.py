"""dtype choice: auto follows the CPU; bfloat16 where the CPU only emulates
bf16 arithmetic runs as fp32 arithmetic on bf16-stored weights."""

import logging

import pytest

from folio.worker import device


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(device, "_bf16_weight_kernel", lambda: True)
    device._say_split_bf16.cache_clear()
    yield
    device._say_split_bf16.cache_clear()


def test_auto_is_float32_and_bfloat16_splits_once(cpu_without_bf16, caplog):
    with caplog.at_level(logging.INFO, logger="folio"):
        assert device.resolve_dtype("auto", "cpu") == "float32"
        assert device.split_cpu_bf16("float32", "cpu") == ("float32", None)
        assert not caplog.records
        assert device.split_cpu_bf16(device.resolve_dtype("bf16", "cpu"), "cpu") == \
            ("float32", "bfloat16")
        assert device.split_cpu_bf16("bfloat16", "cpu") == ("float32", "bfloat16")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no native bf16" in said[0] and "float32 arithmetic" in said[0]


def test_native_bf16_cpu_keeps_bfloat16(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger="folio"):
        assert device.resolve_dtype("auto", "cpu") == "bfloat16"
        assert device.split_cpu_bf16("bfloat16", "cpu") == ("bfloat16", None)
    assert not caplog.records


def test_without_the_kernel_bfloat16_stays(cpu_without_bf16, monkeypatch):
    monkeypatch.setattr(device, "_bf16_weight_kernel", lambda: False)
    assert device.split_cpu_bf16("bfloat16", "cpu") == ("bfloat16", None)


def test_cuda_keeps_bfloat16(cpu_without_bf16):
    assert device.split_cpu_bf16("bfloat16", "cuda") == ("bfloat16", None)


def test_float16_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        device.resolve_dtype("float16", "cpu")
