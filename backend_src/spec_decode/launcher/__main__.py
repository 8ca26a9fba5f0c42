"""``python -m spec_decode.launcher``: serve the model repository (what ``make serve`` runs)."""

import sys

from .server import main

sys.exit(main())
