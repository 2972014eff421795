"""Make the AWQ test checkpoints with gptqmodel's AWQ, and transformers'
reference logits for each (issue 16).

Run by scripts/make_quant_fixtures.sh (after make_quant_fixtures.py) in the
same throwaway venv. Same tiny model, shapes, calibration data and prompts as
make_quant_fixtures.py (imported from it), so only the method differs.

    python scripts/make_awq_fixtures.py OUT_DIR

Writes OUT_DIR/<name>/ (the checkpoint as gptqmodel saves it) and, in each,
reference.safetensors: transformers' float32 logits for the prompts, loading
that same checkpoint (transformers runs AWQ through gptqmodel's kernels).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_quant_fixtures import SHAPE, calibration, make_tiny_model, reference  # noqa: E402

# name -> QuantizeConfig arguments. gptqmodel writes zero_point = not sym.
VARIANTS = {
    "awq-w4-g32": dict(bits=4, group_size=32, sym=False, quant_method="awq", format="gemm"),
}


def main(out: Path) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_model(Path(tmp) / "float", **SHAPE)
        for name, args in VARIANTS.items():
            # no disk offload: its default path is a random temp dir that is
            # written into config.json, so the bytes would differ run to run
            config = QuantizeConfig(**args, offload_to_disk=False)
            model = GPTQModel.load(source, config)
            # AUTO picks the CUDA-only AWQ_GEMM kernel; the torch one runs on CPU
            model.quantize(calibration(), batch_size=1, backend=BACKEND.AWQ_TORCH)
            target = out / name
            model.save(str(target))
            (target / "quant_log.csv").unlink(missing_ok=True)
            reference(target)
            print(f"{name}: {sum(f.stat().st_size for f in target.iterdir()) // 1024} KiB",
                  flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
