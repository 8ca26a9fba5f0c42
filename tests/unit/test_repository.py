"""The model repository as a clone has it: every model has a config and a version folder Triton can load."""

import subprocess
from pathlib import Path

from spec_decode.launcher import DEFAULT_REPOSITORY, MODELS


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
