"""The EAGLE heads' proposers: EAGLE-1/2 (:class:`EagleHead`, published heads) and EAGLE-3 (:class:`Eagle3Head`, the
head ``make speculator`` trains and published ones), each sequence's context in them, and where the trained head is
kept."""

from .artifacts import REPORT_FILE, default_eagle_dir
from .context import EagleContext
from .eagle3 import Eagle3Head
from .eagle3_published import load_eagle3
from .model import EagleHead, eagle_config
from .proposer import Eagle3Proposer, EagleProposer
from .published import load_eagle1

__all__ = ["REPORT_FILE", "Eagle3Head", "Eagle3Proposer", "EagleContext", "EagleHead", "EagleProposer",
           "default_eagle_dir", "eagle_config", "load_eagle1", "load_eagle3"]
