"""Make ``fake_engine`` importable from the core tests whatever pytest's import mode."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
