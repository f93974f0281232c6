"""The ``fsdp-peft`` command."""

from __future__ import annotations

import shutil

from conftest import REPO, run_command


def test_validate_accepts_a_shipped_config_and_rejects_a_broken_one(tmp_path):
    exe = shutil.which("fsdp-peft")
    assert exe, "the console script is installed with the package"
    good = run_command([exe, "validate", str(REPO / "configs" / "llama_qlora" / "llama3_1_8b.yaml")], timeout=120)
    assert good.returncode == 0 and good.stdout.strip().endswith("llama3_1_8b.yaml: ok")
    bad = tmp_path / "bad.yaml"
    bad.write_text("load_in_4bit: true\nbnb_4bit_quant_storage: float32\nbf16: true\n")
    result = run_command([exe, "validate", str(bad)], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "error: bnb_4bit_quant_storage: 'float32' differs from the dtype FSDP gathers in ('bfloat16'"
    )
