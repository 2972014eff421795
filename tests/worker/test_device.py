"""dtype choice: auto follows the CPU; an explicit bfloat16 where the CPU only
emulates it runs, with one warning that says so and what is faster."""

import logging

import pytest

from folio.worker import device


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    device._warn_emulated_bf16.cache_clear()
    yield
    device._warn_emulated_bf16.cache_clear()


def test_auto_is_float32_and_bfloat16_warns_once(cpu_without_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger="folio"):
        assert device.resolve_dtype("auto", "cpu") == "float32"
        assert not caplog.records
        assert device.resolve_dtype("bfloat16", "cpu") == "bfloat16"
        assert device.resolve_dtype("bf16", "cpu") == "bfloat16"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "emulated" in warnings[0] and "float32" in warnings[0]


def test_native_bf16_cpu_picks_bfloat16_without_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.WARNING, logger="folio"):
        assert device.resolve_dtype("auto", "cpu") == "bfloat16"
        assert device.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert not caplog.records


def test_float16_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        device.resolve_dtype("float16", "cpu")
