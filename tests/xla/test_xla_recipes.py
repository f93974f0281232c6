"""The LoRA recipes on PyTorch/XLA, on simulated XLA:CPU devices (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``).

Collected only where torch_xla is installed (tests/conftest.py), i.e. in the TPU environment that
``.ci/run`` builds (torch 2.9.0 + torch-xla 2.9.0); there a failing ``import torch_xla`` is an error, not a
skip. Every run is the real recipe; the reference is the same recipe on the plain CPU (``USE_TORCH_XLA=0``,
one process) with the same global batch.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch_xla  # noqa: F401  (an error, not a skip, where the TPU environment is broken)
from safetensors.torch import load_file

from conftest import REPO, run_command
from fsdp_peft.core.errors import ConfigError
from fsdp_peft.model.paths import tiny_model_path
from fsdp_peft.recipe import parse_recipe_config
from fsdp_peft.tools.export import export_merged

RECIPE = str(REPO / "recipes" / "llama_lora.py")
PROBE = str(REPO / "tests" / "xla" / "probe.py")
RUN = (
    "--max_steps 5 --logging_steps 1 --per_device_train_batch_size 8 --max_seq_length 32 "
    "--per_device_eval_batch_size 200 --generate_eval_samples 0 --disable_tqdm true"
).split()
WITH_SAMPLES = ["--generate_samples", "2", "--generate_max_new_tokens", "2", "--generate_batch_size", "2"]
NO_SAMPLES = ["--generate_samples", "0"]
SPMD, FSDP_V1 = ["--fsdp", "true"], ["--fsdp", "true", "--fsdp_config", '{"xla_fsdp_v2": false}']
TOLERANCE = 1e-5
DECODER_LAYERS = 4  # tiny-llama


def xla_env(devices: int | None) -> dict:
    if devices is None:  # the plain CPU: transformers and accelerate leave torch_xla alone
        return {"USE_TORCH_XLA": "0", "PJRT_DEVICE": ""}
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2"}


def launch(output_dir: Path, devices: int | None, *arguments: str, probe: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    os.environ.clear()
    os.environ.update({**env, **xla_env(devices)})
    try:
        command = [sys.executable, *([PROBE] if probe else []), RECIPE, "--output_dir", str(output_dir)]
        result = run_command([*command, *RUN, *arguments], timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (output_dir / "launch.log").write_text(result.stdout + result.stderr)  # what the user saw
    return result


def losses(output_dir: Path) -> dict[int, float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def assert_close(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got.keys() == expected.keys()
    for step in expected:
        assert abs(got[step] - expected[step]) <= TOLERANCE * abs(expected[step]), (step, got[step], expected[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The recipe on the CPU, on 2 and 4 SPMD devices, under FSDP v1, and resumed from an SPMD checkpoint."""
    root = tmp_path_factory.mktemp("xla_runs")
    out = {name: root / name for name in ("cpu", "spmd2", "spmd4", "v1", "resumed")}
    launch(out["cpu"], None, *WITH_SAMPLES)
    launch(out["spmd2"], 2, *SPMD, *WITH_SAMPLES, "--save_strategy", "steps", "--save_steps", "3", probe=True)
    launch(out["spmd4"], 4, *SPMD, *NO_SAMPLES, "--save_strategy", "no", probe=True)
    launch(out["v1"], 1, *FSDP_V1, *NO_SAMPLES, "--save_strategy", "no", probe=True)
    checkpoint = out["spmd2"] / "checkpoint-3"
    launch(out["resumed"], 2, *SPMD, *NO_SAMPLES, "--resume_from_checkpoint", str(checkpoint), "--save_strategy", "no")
    return out


@pytest.mark.parametrize("devices", [2, 4])
def test_spmd_shards_every_parameter_over_the_mesh_and_trains_as_on_the_cpu(runs, devices):
    probe = json.loads((runs[f"spmd{devices}"] / "xla_probe.json").read_text())
    shardings = probe["shardings"]
    assert len(shardings) > 50
    specs = set(shardings.values())
    # a 2-D weight is split over the fsdp axis (or, too small for it, over its second dimension); 1-D over it
    assert specs <= {
        f"{{devices=[{devices},1]{','.join(map(str, range(devices)))}}}",
        f"{{devices=[1,{devices}]{','.join(map(str, range(devices)))}}}",
        f"{{devices=[{devices}]{','.join(map(str, range(devices)))}}}",
    }, specs
    base = [name for name in shardings if name.endswith("q_proj.base_layer.weight")]
    assert len(base) == DECODER_LAYERS and all(shardings[n].startswith(f"{{devices=[{devices},1]") for n in base)
    assert sorted(probe["checkpointed"].values()) == ["LlamaDecoderLayer"] * DECODER_LAYERS
    assert_close(losses(runs[f"spmd{devices}"]), losses(runs["cpu"]))


@pytest.mark.parametrize("devices", [2, 4])
def test_an_spmd_run_says_how_it_is_sharded(runs, devices):
    """As GPU and CPU runs print their FSDP units: the mesh, its devices, the sharded parameters (those the
    probe saw sharded, of all) and the checkpointed layers, one line."""
    shardings = json.loads((runs[f"spmd{devices}"] / "xla_probe.json").read_text())["shardings"]
    sharded = sum(1 for spec in shardings.values() if spec.startswith("{devices="))
    expected = (
        f"XLA FSDP v2 (SPMD): mesh {{'fsdp': {devices}, 'tensor': 1}} over {devices} devices; sharded parameters: "
        f"{sharded}/{len(shardings)}; checkpointed layers: {DECODER_LAYERS}"
    )
    assert sharded == len(shardings) > 50
    assert expected in (runs[f"spmd{devices}"] / "launch.log").read_text()


def test_an_fsdp_v1_run_says_how_it_is_sharded(runs):
    log = (runs["v1"] / "launch.log").read_text()
    summary = rf"XLA FSDP v1: \d+ units over 1 device; checkpointed layers: {DECODER_LAYERS}\n"
    assert re.search(summary, log), log[-2000:]


def test_fsdp_v1_on_one_device_checkpoints_every_decoder_layer_and_trains_as_on_the_cpu(runs):
    probe = json.loads((runs["v1"] / "xla_probe.json").read_text())
    # counted at the checkpoint call: without input grads the first layer (frozen embedding) is skipped
    assert sorted(probe["checkpointed"].values()) == ["LlamaDecoderLayer"] * DECODER_LAYERS
    assert_close(losses(runs["v1"]), losses(runs["cpu"]))


def test_resuming_from_an_xla_checkpoint_repeats_the_uninterrupted_losses(runs):
    history = json.loads((runs["resumed"] / "trainer_state.json").read_text())["log_history"]
    steps = [entry["step"] for entry in history if "loss" in entry]
    assert steps == [1, 2, 3, 4, 5]  # 1-3 come with checkpoint-3, 4-5 trained after resuming
    resumed, uninterrupted = losses(runs["resumed"]), losses(runs["spmd2"])
    assert_close({step: resumed[step] for step in (4, 5)}, {step: uninterrupted[step] for step in (4, 5)})
    assert json.loads((runs["resumed"] / "results.json").read_text())["steps"] == 5


def test_the_summary_on_xla_prints_the_same_lines_as_on_the_cpu(runs):
    def summary(output_dir: Path) -> list[str]:
        results = json.loads((output_dir / "results.json").read_text())
        from fsdp_peft.procedures.ending import summary as render
        from fsdp_peft.procedures.procedure import exact_match_lines

        text = render(results, output_dir, exact_match_lines).replace(str(output_dir), "OUT")
        return [re.sub(r"\d+\.\d+", "N", line) for line in text.splitlines()]

    cpu, xla = summary(runs["cpu"]), summary(runs["spmd2"])
    assert xla == cpu and len(cpu) >= 8, (xla, cpu)
    log = (runs["spmd2"] / "results.json").read_text()
    assert '"exact_match_after"' in log and json.loads(log)["steps"] == 5


def test_the_adapter_exported_from_an_xla_run_equals_the_cpu_runs_export(runs, tmp_path):
    """Same tensors in, same tensors out: the XLA run's adapter directory exports exactly like the CPU run's
    directory holding the same tensors; and the XLA-trained tensors are the CPU-trained ones within 1e-5."""
    xla_adapter, cpu_adapter = runs["spmd2"] / "adapter", runs["cpu"] / "adapter"
    xla_tensors = load_file(xla_adapter / "adapter_model.safetensors")
    cpu_tensors = load_file(cpu_adapter / "adapter_model.safetensors")
    assert xla_tensors.keys() == cpu_tensors.keys() and len(xla_tensors) == 2 * 7 * DECODER_LAYERS
    for name, tensor in xla_tensors.items():
        assert torch.allclose(tensor, cpu_tensors[name], rtol=TOLERANCE, atol=1e-7), name
    swapped = tmp_path / "cpu_adapter_with_xla_tensors"
    swapped.mkdir()
    for path in cpu_adapter.iterdir():
        (swapped / path.name).write_bytes(path.read_bytes())
    (swapped / "adapter_model.safetensors").write_bytes((xla_adapter / "adapter_model.safetensors").read_bytes())
    for adapter, merged in ((xla_adapter, tmp_path / "from_xla"), (swapped, tmp_path / "from_cpu")):
        export_merged(adapter, merged, base=tiny_model_path(), dtype="fp32", overwrite=True, progress=False)
    from_xla, from_cpu = (load_file(tmp_path / d / "model.safetensors") for d in ("from_xla", "from_cpu"))
    assert from_xla.keys() == from_cpu.keys() and len(from_xla) > 30
    assert all(torch.equal(from_xla[name], from_cpu[name]) for name in from_cpu)


def test_greedy_generation_from_the_spmd_sharded_model_gives_the_unsharded_tokens(runs):
    env = {k: v for k, v in os.environ.items()}
    os.environ.update(xla_env(2))
    try:
        script = str(REPO / "tests" / "xla" / "sharded_generation.py")
        result = run_command([sys.executable, script, str(runs["spmd2"] / "adapter")], timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2 and all(s.startswith("{devices=[") for s in report["shardings"].values())
    assert len(report["sharded"]) == 4 and all(len(tokens) == 6 for tokens in report["sharded"])
    assert report["sharded"] == report["unsharded"]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            ["--config", str(REPO / "configs" / "llama_qlora" / "tiny.yaml")],
            "load_in_4bit: true on XLA (PJRT_DEVICE=CPU): bitsandbytes has no XLA backend",
        ),
        (
            ["--fsdp", "true", "--fsdp_config", '{"version": 2, "xla_fsdp_v2": true}'],
            "fsdp_config: version: torch FSDP (GPU) setting on XLA (PJRT_DEVICE=CPU)",
        ),
        (["--fsdp", "full_shard offload"], "fsdp_config: offload: torch FSDP (GPU) setting on XLA"),
    ],
)
def test_what_cannot_run_on_xla_is_refused_before_anything_starts(arguments, message, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    config = REPO / "configs" / "llama_lora" / "tiny.yaml"
    with pytest.raises(ConfigError) as error:
        parse_recipe_config(["--config", str(config), "--output_dir", str(tmp_path), *arguments], config, "x")
    assert str(error.value).startswith(message), str(error.value)
    assert not (tmp_path / "fsdp_peft_run.json").exists()


def test_the_optimizer_fix_is_needed_and_applies(tmp_path):
    """Without `xla_fsdp_optimizer_created`, transformers 5.24 fails before the first step (the fix is still
    needed); the runs above train with it (it applies)."""
    unpatched = (
        "import contextlib, runpy, sys; import fsdp_peft.parallel.shard as t; "
        "t.xla_fsdp_optimizer_created = lambda trainer: contextlib.nullcontext(); "
        f"sys.argv = [{RECIPE!r}, '--output_dir', {str(tmp_path / 'out')!r}, *{[*RUN, *SPMD, *NO_SAMPLES]!r}]; "
        f"runpy.run_path({RECIPE!r}, run_name='__main__')"
    )
    env = {k: v for k, v in os.environ.items()}
    os.environ.update(xla_env(1))
    try:
        result = run_command([sys.executable, "-c", unpatched], timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert result.returncode != 0
    assert "'NoneType' object has no attribute 'param_groups'" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*/tpu_*.yaml")), ids=lambda p: p.name)
def test_tpu_configs_validate_on_xla_and_open_with_their_header(config, monkeypatch, capsys):
    from fsdp_peft import cli

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    cli.main(["validate", str(config)])
    assert capsys.readouterr().out.strip() == f"{config}: ok"
    header = config.read_text().split("\n\n")[0]
    assert f"PJRT_DEVICE=TPU python recipes/{config.parent.name}.py --config configs/" in header
    assert "# Hardware: one TPU v" in header and "Expected HBM per chip: about " in header
    assert f"fsdp-peft plan configs/{config.parent.name}/{config.name} --gpus" in header


def test_tpu_config_headers_give_the_plans_hbm_per_chip(monkeypatch, tmp_path):
    """The documented ``PJRT_DEVICE=TPU fsdp-peft plan ...`` line of each TPU config, on the model's published
    config.json (offline, as tests/test_docs.py serves it): its total is the header's figure."""
    from test_docs import HUB_CONFIGS

    from fsdp_peft.procedures.registry import plan_config

    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    for config in sorted((REPO / "configs").glob("*/tpu_*.yaml")):
        header = config.read_text().split("\n\n")[0]
        command = re.search(r"PJRT_DEVICE=TPU fsdp-peft plan (\S+) --gpus (\d+) --gpu-memory (\d+)GiB", header)
        assert command and command.group(1) == f"configs/{config.parent.name}/{config.name}"
        model = re.search(r"(?m)^model_name_or_path: (\S+)", config.read_text()).group(1)
        (tmp_path / config.stem).mkdir()
        (tmp_path / config.stem / "config.json").write_text(json.dumps(HUB_CONFIGS[model]))
        local = tmp_path / config.name
        local.write_text(config.read_text().replace(model, str(tmp_path / config.stem)))
        plan = plan_config(local, int(command.group(2)), int(command.group(3)) * 2**30)
        assert plan.fsdp == "XLA FSDP v2 (SPMD)" and plan.activation_checkpointing and plan.fits
        assert f"Expected HBM per chip: about {plan.gpu_total / 2**30:.1f} GiB" in header, plan.gpu_total / 2**30
