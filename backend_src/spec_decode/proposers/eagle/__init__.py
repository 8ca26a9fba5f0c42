"""The EAGLE head proposer: the head's model, each sequence's context in it, the proposer, and where heads are kept."""

from .artifacts import REPORT_FILE, default_eagle_dir, resolve_eagle_path
from .context import EagleContext
from .model import EagleHead, eagle_config
from .proposer import EagleProposer, EagleSettings

__all__ = ["REPORT_FILE", "EagleContext", "EagleHead", "EagleProposer", "EagleSettings", "default_eagle_dir",
           "eagle_config", "resolve_eagle_path"]
