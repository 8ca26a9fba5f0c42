"""The launcher: starts tritonserver on the model repository, watches its model processes and heals them.

Modules: :mod:`.server` (:class:`TritonServer`), :mod:`.healer` (bringing dead model processes back), :mod:`.frontend`
(the OpenAI frontend's process, started, watched and restarted), :mod:`.events` (their recovery events),
:mod:`.processes` (finding and inspecting a tritonserver's model processes; free ports), :mod:`.embedded` (the
tritonserver to run), :mod:`.repository` (the model repository served and what its configs say), :mod:`.__main__` (the
command line: ``python -m spec_decode.launcher`` is what ``make serve`` and the Docker image run). Tests start
:class:`TritonServer` on free ports.
"""

from .embedded import embedded_server_dir
from .processes import free_ports
from .repository import DEFAULT_REPOSITORY, MODELS, draft_overrides, prepare_repository, served_methods
from .server import TritonServer

__all__ = ["DEFAULT_REPOSITORY", "MODELS", "TritonServer", "draft_overrides", "embedded_server_dir", "free_ports",
           "prepare_repository", "served_methods"]
