"""The launcher: starts tritonserver on the model repository, watches its model processes and heals them.

``python -m spec_decode.launcher`` is what ``make serve`` and the Docker image run; tests start
:class:`TritonServer` on free ports.
"""

from .server import (
    DEFAULT_REPOSITORY,
    MODELS,
    TritonServer,
    draft_overrides,
    embedded_server_dir,
    free_ports,
    prepare_repository,
    served_methods,
)

__all__ = ["DEFAULT_REPOSITORY", "MODELS", "TritonServer", "draft_overrides", "embedded_server_dir", "free_ports",
           "prepare_repository", "served_methods"]
