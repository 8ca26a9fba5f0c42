"""The model repository as a clone has it: every model has a config and a version folder Triton can load."""

import subprocess
from pathlib import Path

from spec_decode.server import DEFAULT_REPOSITORY, MODELS


def test_every_model_has_config_and_tracked_version_folder():
    tracked = subprocess.run(["git", "ls-files", "model_repository"], cwd=DEFAULT_REPOSITORY.parent,
                             capture_output=True, text=True, check=True).stdout.split()
    for model in MODELS:
        assert (DEFAULT_REPOSITORY / model / "config.pbtxt").is_file(), model
        # git does not store empty folders: a version folder exists in a clone only if a file in it is tracked
        assert any(p.startswith(f"model_repository/{model}/1/") for p in tracked), f"{model}/1/ is not tracked"
    assert sorted(p.name for p in DEFAULT_REPOSITORY.iterdir() if p.is_dir()) == sorted(MODELS)


def test_python_models_have_model_py():
    for model in MODELS:
        cfg = (DEFAULT_REPOSITORY / model / "config.pbtxt").read_text()
        if 'backend: "python"' in cfg:
            assert (Path(DEFAULT_REPOSITORY) / model / "1" / "model.py").is_file(), model


def test_client_and_bench_modules_import():
    import importlib

    for mod in ("client.generate", "client.bench", "client.datasets"):
        importlib.import_module(mod)
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "verifier.py"), run_name="not_main")


def _init_args(model: str, kind: str, device_id: str) -> dict:
    """The args Triton's Python backend passes to initialize(): the model's config as JSON and its instance."""
    import json

    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse((DEFAULT_REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
            "model_instance_kind": kind, "model_instance_device_id": device_id, "model_instance_name": f"{model}_0"}


def test_a_gpu_instance_places_the_step_models_on_its_gpu_and_a_configured_device_overrides():
    import json

    from spec_decode.serving.adapter import model_parameters

    for model in ("target_model", "draft_model"):
        assert model_parameters(_init_args(model, "GPU", "3"))["device"] == "cuda:3"
        assert model_parameters(_init_args(model, "GPU", "0"))["device"] == "cuda:0"
        assert model_parameters(_init_args(model, "CPU", "0"))["device"] == "auto"  # the shipped default
        assert model_parameters(_init_args(model, "MODEL", "0"))["device"] == "auto"
        args = _init_args(model, "GPU", "1")
        cfg = json.loads(args["model_config"])
        cfg["parameters"]["device"] = {"string_value": "cuda:0"}
        args["model_config"] = json.dumps(cfg)
        assert model_parameters(args)["device"] == "cuda:0"  # config.pbtxt's device wins
        cfg["parameters"]["device"] = {"string_value": "cpu"}
        args["model_config"] = json.dumps(cfg)
        assert model_parameters(args)["device"] == "cpu"
